"""Sandboxes: where the agent's model-written shell commands run — as root, on the trainer's host.

Two sandboxes, one interface (`Sandbox`: `run`, `write_file`, `diff`, `close`, `workdir`):

* `LocalSandbox`: a temporary copy of a task's repository, made a git repository whose one commit
  is the base; every command runs under bubblewrap in namespaces of its own. What a command sees
  and may do (each point is tried from inside, as root, by tests/test_sandbox.py):
  - Files: the system's program and library folders (/usr and the /bin, /lib links) and our
    Python installation, read-only; a curated /etc (`ETC_ENTRIES`: no shadow, no credentials,
    passwd and group written for the sandbox); the task copy and a private HOME, writable; a
    size-capped /tmp and /dev/shm. Nothing else of the host: not /root, /home, /run, /var, the
    checkout, nor any host socket. The root is read-only and the command holds no capability in
    the mount namespace, so no mount can be changed or undone.
  - Privileges: when the trainer runs as root, each sandbox gets an unprivileged uid of its own
    (setpriv: no capabilities, an empty bounding set, no_new_privs), so even a way out would land
    as nobody in particular; otherwise commands run as the user in a user namespace with every
    capability dropped. Either way a seccomp filter (x86_64, aarch64) refuses new user namespaces,
    which would give capabilities back.
  - Processes and network: an own PID namespace (everything dies with the command), an own
    network namespace (no host TCP, no abstract sockets), own IPC and host name.
  - Limits (`Limits`): wall time (each `run`'s timeout), processes, memory, file size, /tmp and
    /dev/shm size, and the task copy + HOME size (checked after every command).
  Without a working bwrap a LocalSandbox refuses to start, unless `isolated=False` says that
  plain processes with the user's rights are wanted.
* `DockerSandbox`: a container of an official SWE-bench image (`docker run -d ... sleep`, then
  `docker exec`), with no network, no capabilities beyond a file-owner set, no_new_privs, and
  the same `Limits` enforced by the container's cgroup.

Sandbox folders and containers carry this process's run id (`RUN_ID`); one whose run is gone (a
killed trainer) is removed when the next run makes its first sandbox.

Where we depart from mini-swe-agent:
* Output is read incrementally and capped in BYTES (head and tail kept); theirs reads it all and
  then elides characters. The buffer holds at most about 1.5x the cap (the head, and a tail
  trimmed whenever it reaches twice its share), however much a command prints.
* Nothing outlives a command: when its shell exits, its PID namespace (without isolation: its
  process group) is killed. Background servers must be started and used within one command.
* HOME is a private folder next to the copy, not the user's, so tool caches stay out of the diff.
"""
from __future__ import annotations

import fcntl
import glob
import logging
import os
import platform
import secrets
import selectors
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

from env import CommandResult

logger = logging.getLogger(__name__)

DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024    # what the agent sees of one command
DIFF_MAX_BYTES = 64 * 1024 * 1024        # a larger patch is an error, never silently truncated
DIFF_TIMEOUT_S = 120.0
COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")   # caches never enter a copy
RUN_ID = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"   # names this process's sandboxes
RUN_LABEL = "compactionrl.run"           # the Docker label that carries RUN_ID
INSTALL_HINT = ("install bubblewrap (`apt-get install bubblewrap`; as root it also needs setpriv, from "
                "util-linux), or pass --allow-unisolated to run agent commands as plain processes with "
                "this user's rights")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the agent's command)."""


class DiffError(SandboxError):
    """No patch could be taken from the sandbox (e.g. the agent broke .git)."""


@dataclass(frozen=True)
class Limits:
    """What one sandbox may use. Local: rlimits of every command (`ulimit` before it starts; no
    capability is left to raise them) and tmpfs sizes; Docker: the container's cgroup."""
    processes: int = 512
    """Processes and threads. Local: RLIMIT_NPROC of the sandbox's uid (as root each sandbox has
    its own uid; otherwise it counts all of the user's processes); Docker: --pids-limit."""
    memory_bytes: int = 8 << 30
    """Local: the address space of each process (RLIMIT_AS); Docker: the whole container, no swap."""
    file_bytes: int = 2 << 30
    """The largest file a command may write (RLIMIT_FSIZE): past it the write fails (SIGXFSZ)."""
    tmp_bytes: int = 1 << 30
    """Local: size of /tmp and of /dev/shm, each (RAM-backed, freed when the command ends)."""
    disk_bytes: int = 8 << 30
    """Local: the task copy and HOME together, checked after every command; past it the sandbox
    raises SandboxError (the episode ends as env_error). Docker: not bounded here (the daemon's
    storage driver decides)."""
    open_files: int = 4096
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    cpus: float = 2.0
    """Docker: CPUs the container may use (--cpus). Local: not bounded (use fewer env workers)."""


def limits_wrapper(limits: Limits) -> list[str]:
    """argv that sets the limits in the command's own shell, then runs the command ("$1").
    bash's ulimit counts -v and -f in KiB and, given neither -S nor -H, sets both soft and hard."""
    set_limits = (f"ulimit -c 0 -n {limits.open_files} -u {limits.processes} "
                  f"-v {limits.memory_bytes // 1024} -f {limits.file_bytes // 1024}")
    return ["bash", "-c", f'{set_limits} && exec bash -c "$1"', "bash"]


# ---------------------------------------------------------------- running a process

class _CappedOutput:
    """Keeps the first and the last `limit/2` bytes of a stream and counts the rest."""

    def __init__(self, limit: int):
        assert limit >= 2, f"max_output_bytes must be at least 2, got {limit}"
        self.head_limit, self.tail_limit = limit - limit // 2, limit // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        take = min(len(chunk), self.head_limit - len(self.head))
        self.head += chunk[:take]
        self.tail += chunk[take:]
        if len(self.tail) > 2 * self.tail_limit:   # trim only now and then: amortized O(1) per byte
            del self.tail[: len(self.tail) - self.tail_limit]

    def result(self, returncode: int, timed_out: bool, errors: str) -> CommandResult:
        if self.total <= self.head_limit + self.tail_limit:
            text = (self.head + self.tail).decode("utf-8", errors)
            return CommandResult(text, returncode, timed_out, truncated=False)
        tail = self.tail[len(self.tail) - self.tail_limit:]
        elided = self.total - len(self.head) - len(tail)
        marker = (f"\n[... output truncated: {self.total} bytes in total, {elided} elided; "
                  f"showing the first {len(self.head)} and the last {len(tail)} bytes ...]\n")
        text = self.head.decode("utf-8", errors) + marker + tail.decode("utf-8", errors)
        return CommandResult(text, returncode, timed_out, truncated=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:   # the group is already empty
        pass


def run_process(argv: list[str], timeout: float, max_output_bytes: int, *, env: dict | None = None,
                cwd: str | None = None, errors: str = "replace", pass_fds: tuple[int, ...] = ()) -> CommandResult:
    """Runs argv in a new session; stdout+stderr read incrementally into a capped buffer.

    When the process exits, or `timeout` passes, its whole process group is SIGKILLed, so its
    background children die with it. Then the pipe is drained only while data keeps coming: a
    process that escaped the group (setsid) cannot hold the call past its deadline.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=cwd, env=env, start_new_session=True, pass_fds=pass_fds)
    out, fd = _CappedOutput(max_output_bytes), proc.stdout.fileno()
    deadline, exited, timed_out = time.monotonic() + timeout, False, False
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if not exited and proc.poll() is not None:
                exited = True
                _kill_group(proc.pid)
            if not selector.select(0.05 if exited else min(remaining, 0.2)):
                if exited:   # quiet pipe after exit: only an escaped process still holds it
                    break
                continue
            if not (chunk := os.read(fd, 1 << 16)):
                break
            out.add(chunk)
        if not exited:   # the deadline passed, or EOF while it runs on (it closed its own stdout)
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        _kill_group(proc.pid)
        drain_until = time.monotonic() + 1.0   # what is left in the pipe; an escaped writer gets 1 s
        while time.monotonic() < drain_until and selector.select(0.05) and (chunk := os.read(fd, 1 << 16)):
            out.add(chunk)
    proc.stdout.close()
    return out.result(proc.wait(), timed_out, errors)


# ---------------------------------------------------------------- seccomp

# seccomp_data offsets, BPF opcodes and return values (linux/seccomp.h, linux/filter.h)
_NR, _ARCH, _ARG0 = 0, 4, 16
_LD, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS, CLONE_NEWUSER = 1, 38, 0x10000000
# audit arch, and the numbers of unshare, clone, clone3 (clone's flags are its first argument on both)
_SYSCALLS = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}


def seccomp_filter(machine: str = platform.machine()) -> bytes | None:
    """A seccomp program (bwrap --seccomp) that refuses new user namespaces: unshare and clone with
    CLONE_NEWUSER fail with EPERM, clone3 with ENOSYS (libc then falls back to clone, whose flags
    a filter can read). A user namespace would give a command every capability again, over
    namespaces of its own: the kernel surface most container escapes go through. Syscalls of
    another ABI (32-bit on a 64-bit kernel) are refused. None on other machines."""
    if machine not in _SYSCALLS:
        return None
    arch, unshare, clone, clone3 = _SYSCALLS[machine]
    program = [(_LD, 0, 0, _ARCH), (_JEQ, 1, 0, arch), (_RET, 0, 0, _ERRNO | _EPERM),
               (_LD, 0, 0, _NR), (_JEQ, 0, 1, clone3), (_RET, 0, 0, _ERRNO | _ENOSYS),
               (_JEQ, 1, 0, unshare), (_JEQ, 0, 3, clone),
               (_LD, 0, 0, _ARG0), (_JSET, 0, 1, CLONE_NEWUSER), (_RET, 0, 0, _ERRNO | _EPERM),
               (_RET, 0, 0, _ALLOW)]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


# ---------------------------------------------------------------- git

BASE_IDENTITY = {  # fixed author and date: the same files always give the same base commit id
    "GIT_AUTHOR_NAME": "CompactionRL", "GIT_AUTHOR_EMAIL": "tasks@compactionrl.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_NAME": "CompactionRL",
    "GIT_COMMITTER_EMAIL": "tasks@compactionrl.invalid", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}


def _host_git(repo: str, *args: str) -> str:
    """git on the host: only on trusted task-author repositories, never after the agent ran."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": os.devnull, **BASE_IDENTITY}
    argv = ["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main"]
    proc = subprocess.run([*argv, *args], cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"`git {' '.join(args)}` failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def commit_base(repo: str) -> str:
    """Makes a plain directory a git repository with one deterministic commit; returns its id."""
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "--allow-empty", "-m", "base")):
        _host_git(repo, *args)
    return _host_git(repo, "rev-parse", "HEAD")


def diff_script(base_commit: str) -> str:
    """A shell script printing the working tree's patch against `base_commit`.

    It runs INSIDE the sandbox: the agent controls .git/config (hooks, fsmonitor, pagers), so git
    on the host would run the agent's code outside the sandbox. A throwaway index started from the
    base tree leaves the agent's staging alone and keeps files tracked at base tracked. `add -A`
    takes every new file but ignored ones, as mini-swe-agent's `git add -A; git diff --cached` does;
    the swebench harness applies whatever patch it gets, so nothing else is excluded. `--binary`
    keeps binary files; fixed prefixes and no renames make it apply with `git apply` and `patch
    -p1`. git's stderr is shown only on failure, so warnings never enter the patch.
    """
    base = shlex.quote(base_commit)
    return ('idx=$(mktemp); err=$(mktemp); trap \'rm -f "$idx" "$err"\' EXIT; export GIT_INDEX_FILE="$idx"\n'
            f'if ! {{ git read-tree {base} && git -c core.fsmonitor=false add -A && git diff --cached '
            f'--binary --no-color --no-ext-diff --no-textconv --no-renames --src-prefix=a/ --dst-prefix=b/ '
            f'{base}; }} 2>"$err"; then cat "$err"; exit 1; fi\n')


QUIET_ENV = {"PAGER": "cat", "GIT_PAGER": "cat", "MANPAGER": "cat",   # never wait for a keypress
             "PIP_PROGRESS_BAR": "off", "TQDM_DISABLE": "1",          # progress bars flood the output
             "PYTHONDONTWRITEBYTECODE": "1"}                          # keep __pycache__ out of diffs


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment of a local command: nothing of ours leaks (proxies, tokens, keys)."""
    # our venv's python, so `python -m pytest` works; by its real path, the one the sandbox binds (a
    # venv reached through a symlink is bound where the link points)
    python_bin = os.path.join(os.path.realpath(sys.prefix), "bin")
    return {"PATH": f"{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": home, "LANG": "C.UTF-8", "TMPDIR": "/tmp", "TERM": "dumb", **QUIET_ENV}


# ---------------------------------------------------------------- run ids and stale sandboxes

_run_dirs: dict[str, object] = {}   # sandbox root -> the open lock file of this process's folder
_run_dirs_lock = threading.Lock()


def sandboxes_root() -> str:
    """Where local sandboxes live: one folder per user under the temp dir."""
    return os.path.join(tempfile.gettempdir(), f"compactionrl-sandboxes-{os.getuid()}")


def _lock_is_free(path: str) -> bool:
    """True when no live process holds the flock on `path` (its run was killed or ended)."""
    try:
        with open(path) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
    except BlockingIOError:
        return False
    except FileNotFoundError:
        return True


def remove_stale_sandboxes(root: str) -> list[str]:
    """Removes the sandbox folders of runs under `root` that no live process holds; returns their
    run ids. A run holds an flock on `<root>/<run id>.lock` for as long as its process lives. The
    remover holds a stale run's lock while it removes the run, so processes that start together
    (the ranks of one job) never remove the same folder at once: the others skip it."""
    stale = []
    for name in sorted(n for n in os.listdir(root) if n.endswith(".lock")):
        try:
            with open(os.path.join(root, name)) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(lock.fileno()).st_nlink == 0:   # another process removed the run meanwhile
                    continue
                if os.path.isdir(folder := os.path.join(root, name[:-len(".lock")])):
                    remove_tree(folder)
                os.unlink(os.path.join(root, name))   # still held: the run is gone only when its lock is
        except (BlockingIOError, FileNotFoundError):   # a live run, or one removed before we looked
            continue
        stale.append(name[:-len(".lock")])
    return stale


def run_dir(root: str) -> str:
    """This process's folder under `root`, made (and stale folders removed) on first use."""
    with _run_dirs_lock:
        if root not in _run_dirs:
            os.makedirs(root, mode=0o700, exist_ok=True)
            if removed := remove_stale_sandboxes(root):
                logger.warning("removed the sandboxes of %d runs that are gone: %s", len(removed), removed)
            # held open for the process's life; locked before it takes its name, so no other process's
            # clean-up ever finds it free
            lock = open(os.path.join(root, RUN_ID + ".lock-new"), "w")
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(lock.name, os.path.join(root, RUN_ID + ".lock"))
            os.makedirs(os.path.join(root, RUN_ID), exist_ok=True)
            _run_dirs[root] = lock
    return os.path.join(root, RUN_ID)


def remove_tree(path: str) -> None:
    """rmtree that also removes folders an agent made unreadable (chmod 000), at any depth (every
    call is relative to an open folder, so a path past PATH_MAX is no obstacle), never following
    a symlink out of the tree. Root needs no chmod: permissions do not bind it."""
    if os.geteuid() != 0:
        for _, dirs, _, fd in os.fwalk(path):   # top-down: a folder is opened after we chmod it
            for name in dirs:
                if stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.chmod(name, 0o700, dir_fd=fd)
    shutil.rmtree(path)


def tree_bytes(path: str) -> int:
    """Disk used under `path`, in bytes: each entry's blocks (a sparse file counts what it uses),
    and at least one 4 KiB block per entry, so a flood of empty files counts too."""
    total = 0
    for _, dirs, files, fd in os.fwalk(path):
        for name in dirs + files:
            total += max(os.stat(name, dir_fd=fd, follow_symlinks=False).st_blocks * 512, 4096)
    return total


# ---------------------------------------------------------------- sandboxes

class Sandbox:
    """The interface; `workdir` is the repository's path as commands see it."""
    workdir: str
    base_commit: str

    def run(self, command: str, timeout: float, max_output_bytes: int | None = None,
            errors: str = "replace") -> CommandResult:
        raise NotImplementedError

    def write_file(self, name: str, text: str) -> str:
        """Writes a file outside the repository (scripts, patches); returns its path in the sandbox."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def diff(self) -> str:
        # surrogateescape: the str round-trips to the exact bytes, so non-UTF-8 files stay intact
        result = self.run(diff_script(self.base_commit), DIFF_TIMEOUT_S, DIFF_MAX_BYTES,
                          errors="surrogateescape")
        if result.returncode != 0 or result.timed_out or result.truncated:
            raise DiffError(f"could not take the diff against {self.base_commit} (returncode "
                            f"{result.returncode}, timed_out={result.timed_out}, "
                            f"truncated={result.truncated}): {result.output[-2000:]}")
        return result.output

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")   # symlinks into /usr on merged-usr
ETC_ENTRIES = ("alternatives", "bash.bashrc", "ca-certificates.conf", "debian_version", "host.conf", "hosts",
               "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types",
               "nsswitch.conf", "os-release", "profile", "profile.d", "protocols", "python3*", "services",
               "ssl/certs", "ssl/openssl.cnf", "timezone")
SANDBOX_UIDS = (1 << 20, 1 << 24)   # as root, each sandbox runs as a random uid of this range: no user has it


def _user_files(uid: int, home: str) -> dict[str, str]:
    """/etc/passwd and /etc/group as commands see them: root, the sandbox's user, nobody."""
    return {"passwd": (f"root:x:0:0:root:/root:/usr/sbin/nologin\nagent:x:{uid}:{uid}:agent:{home}:/bin/bash\n"
                       "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
            "group": f"root:x:0:\nagent:x:{uid}:\nnogroup:x:65534:\n"}


def _chown_tree(path: str, uid: int) -> None:
    os.chown(path, uid, uid)
    for _, dirs, files, fd in os.fwalk(path):
        for name in dirs + files:
            os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)


class LocalSandbox(Sandbox):
    """A temporary copy of `repo_dir`, commands under bubblewrap (see the module docstring).

    Under a fresh folder of this run (`run_dir`): `repo/` (`workdir`), `home/` (HOME: the only
    other writable path, so tool caches and dotfiles stay out of the diff), `files/` (read-only to
    commands: what `write_file` wrote) and `etc/` (passwd and group). Paths are the same inside
    and outside the sandbox. If the copy has no .git, it is committed as the base and must match
    `base_commit` if given; if it has one, `base_commit` (default HEAD) is checked out.
    `read_only`: more host folders commands may read (e.g. a toolchain outside /usr).
    """

    def __init__(self, repo_dir: str, base_commit: str | None = None, *, root: str | None = None,
                 isolated: bool = True, bwrap: str = "bwrap", limits: Limits = Limits(),
                 read_only: tuple[str, ...] = (), max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES):
        self.limits, self.max_output_bytes = limits, max_output_bytes
        self.read_only = tuple(os.path.abspath(p) for p in read_only)
        if missing := [p for p in self.read_only if not os.path.isdir(p)]:
            raise ValueError(f"read_only: not existing directories: {missing}")
        self.tmp = tempfile.mkdtemp(prefix="sandbox-", dir=run_dir(root or sandboxes_root()))
        self.workdir, self.home, self.files, self.etc = (os.path.join(self.tmp, d)
                                                         for d in ("repo", "home", "files", "etc"))
        try:
            shutil.copytree(repo_dir, self.workdir, symlinks=True, ignore=COPY_IGNORE)
            for d in (self.home, self.files, self.etc):
                os.mkdir(d)
            self.base_commit = self._make_base(base_commit)
            as_root = isolated and os.geteuid() == 0
            self.uid = secrets.randbelow(SANDBOX_UIDS[1] - SANDBOX_UIDS[0]) + SANDBOX_UIDS[0] if as_root \
                else os.getuid()
            for name, text in _user_files(self.uid, self.home).items():
                with open(os.path.join(self.etc, name), "w") as f:
                    f.write(text)
            if as_root:   # bwrap enters the copy as root without capabilities: the owner's x bit is not enough
                for folder in (self.workdir, self.home):
                    _chown_tree(folder, self.uid)
                    os.chmod(folder, 0o755)
            self.seccomp = os.path.join(self.etc, "seccomp.bpf")
            with open(self.seccomp, "wb") as f:
                f.write(seccomp_filter() or b"")
            self.isolation, self._prefix = "none", []
            if isolated:
                self._isolate(bwrap, as_root)
        except BaseException:
            remove_tree(self.tmp)
            raise
        if not isolated:
            logger.warning("SANDBOX IS NOT ISOLATED (asked for): agent commands in %s run as plain "
                           "processes with this user's rights, files and network", self.workdir)

    def _make_base(self, base_commit: str | None) -> str:
        if os.path.isdir(os.path.join(self.workdir, ".git")):
            _host_git(self.workdir, "checkout", "-q", "--detach", "-f", base_commit or "HEAD")
            return _host_git(self.workdir, "rev-parse", "HEAD")
        made = commit_base(self.workdir)
        if base_commit is not None and made != base_commit:
            raise ValueError(f"the task's files give base commit {made}, but its row says {base_commit}: "
                             "the repository changed since the row was built")
        return made

    def _bwrap_argv(self, bwrap: str, as_root: bool) -> list[str]:
        if as_root:   # privileged bwrap: no user namespace; setpriv then leaves root for self.uid
            setup = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                     "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_SETPCAP"]
            become = ["setpriv", "--reuid", str(self.uid), "--regid", str(self.uid), "--clear-groups",
                      "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        else:
            setup = ["--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
            become = []
        t = str(self.limits.tmp_bytes)
        mounts = ["--dev", "/dev", "--perms", "1777", "--size", t, "--tmpfs", "/dev/shm", "--proc", "/proc",
                  "--perms", "1777", "--size", t, "--tmpfs", "/tmp"]   # /tmp first: binds may lie under it
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                mounts += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                mounts += ["--ro-bind", path, path]
        etc = [path for pattern in ETC_ENTRIES for path in sorted(glob.glob(os.path.join("/etc", pattern)))]
        binds = [("--ro-bind", p, p) for p in [*etc, *self._python_dirs(), *self.read_only, self.files]]
        binds += [("--bind", p, p) for p in (self.workdir, self.home)]
        binds += [("--ro-bind", os.path.join(self.etc, name), f"/etc/{name}") for name in ("passwd", "group")]
        mounts += _parent_dirs([dest for _, _, dest in binds])
        for bind in binds:
            mounts += bind
        return [bwrap, *setup, "--die-with-parent", "--new-session", "--hostname", "sandbox", *mounts,
                "--remount-ro", "/", "--chdir", self.workdir, "--", *become]

    @staticmethod
    def _python_dirs() -> list[str]:
        """Our Python (venv and the installation it points to), unless /usr already holds it."""
        prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
        return sorted(p for p in prefixes if not any(_is_under(p, d) for d in SYSTEM_DIRS))

    def _isolate(self, bwrap: str, as_root: bool) -> None:
        """Sets the bwrap argv prefix, probed once; SandboxError naming the fix when it cannot work."""
        path = shutil.which(bwrap)
        if path is None:
            problem = f"the bubblewrap executable {bwrap!r} was not found"
        elif as_root and shutil.which("setpriv") is None:
            problem = "setpriv (util-linux) was not found; as root it drops to the sandbox's own uid"
        else:
            self.isolation, self._prefix = "bwrap", self._bwrap_argv(path, as_root)
            probe = self._run("true", 10.0, 4096, "replace")
            if probe.returncode == 0:
                return
            problem = f"bubblewrap does not work here (returncode {probe.returncode}): {probe.output.strip()}"
        raise SandboxError(f"cannot isolate agent commands: {problem}. Fix: {INSTALL_HINT}.")

    def run(self, command, timeout, max_output_bytes=None, errors="replace") -> CommandResult:
        if "\0" in command:
            raise SandboxError("a command cannot contain a NUL byte (env.parse_action rejects it first)")
        result = self._run(command, timeout, max_output_bytes or self.max_output_bytes, errors)
        if (used := tree_bytes(self.workdir) + tree_bytes(self.home)) > self.limits.disk_bytes:
            raise SandboxError(f"the sandbox's files take {used} bytes, over its limit of "
                               f"{self.limits.disk_bytes} (Limits.disk_bytes)")
        return result

    def _run(self, command, timeout, max_output_bytes, errors) -> CommandResult:
        argv = [*limits_wrapper(self.limits), command]
        if self.isolation == "none":
            return run_process(argv, timeout, max_output_bytes, env=sandbox_env(self.home), cwd=self.workdir,
                               errors=errors)
        with open(self.seccomp, "rb") as program:   # bwrap reads the filter from an inherited fd
            filter_args = ["--seccomp", str(program.fileno())] if os.path.getsize(self.seccomp) else []
            return run_process([self._prefix[0], *filter_args, *self._prefix[1:], *argv], timeout,
                               max_output_bytes, env=sandbox_env(self.home), cwd=self.workdir, errors=errors,
                               pass_fds=(program.fileno(),))

    def write_file(self, name: str, text: str) -> str:
        path = os.path.join(self.files, f"{uuid.uuid4().hex[:8]}-{os.path.basename(name)}")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        return path

    def close(self) -> None:
        if os.path.isdir(self.tmp):
            remove_tree(self.tmp)


def _is_under(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder


def _parent_dirs(paths: list[str]) -> list[str]:
    """bwrap args that make every missing parent of `paths` a 0755 folder (bwrap's own are 0700,
    which an unprivileged uid could not cross). /tmp and the system folders already exist."""
    made = {"/", "/tmp", *SYSTEM_DIRS}
    args = []
    for path in paths:
        parents = []
        while (path := os.path.dirname(path)) not in made and path != "/":
            parents.append(path)
        for parent in reversed(parents):
            made.add(parent)
            args += ["--perms", "0755", "--dir", parent]
    return args


def check_isolation(bwrap: str = "bwrap") -> None:
    """Raises SandboxError, naming the fix, when local sandboxes cannot isolate commands here.
    Entry points call it before loading any model."""
    with tempfile.TemporaryDirectory() as empty:
        LocalSandbox(empty, bwrap=bwrap).close()


# ---------------------------------------------------------------- docker

ROOT_LABEL = "compactionrl.sandboxes"   # the Docker label that carries the run's sandboxes root


def docker_available(docker: str = "docker", timeout: float = 20.0) -> bool:
    """True when a Docker daemon answers `docker info`."""
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=timeout).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


def check_docker_images(images: list[str], docker: str = "docker", pull: bool = False) -> None:
    """Entry points call it before loading any model: a daemon must answer, and every image must
    be present, or, with `pull`, is pulled now (else `docker run` would pull it in the middle of a
    run, once per episode, and a failed pull would end episodes as env_error). SandboxError naming
    the missing images and how to get them."""
    if not docker_available(docker):
        raise SandboxError(f"the Docker sandbox needs a Docker daemon, and `{docker} info` got no answer "
                           "(start one: dockerd, or systemctl start docker)")
    held = set(_docker(docker, "images", "--format", "{{.Repository}}:{{.Tag}}").split())
    missing = [image for image in images
               if (image if ":" in image.rsplit("/", 1)[-1] else f"{image}:latest") not in held]
    for image in missing if pull else []:
        logger.warning("pulling %s", image)
        _docker(docker, "pull", "-q", image, timeout=3600.0)
    if missing and not pull:
        raise SandboxError(f"{len(missing)} of {len(images)} task images are not present locally (e.g. "
                           f"{missing[0]}): build them (the built-in tasks: python -m tasks.swe.build_images), "
                           f"pull them (docker pull {missing[0]}), or pass --pull-images")


def _docker_call(docker: str, *args: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
    """Runs the docker CLI; SandboxError, with its stderr, when it is missing, hangs or fails."""
    try:
        proc = subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise SandboxError(f"the docker CLI {docker!r} is not installed") from e
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"`{docker} {' '.join(args[:2])} ...` did not answer within {timeout:g} s") from e
    if proc.returncode != 0:
        raise SandboxError(f"`{docker} {' '.join(args[:2])} ...` failed: {proc.stderr.strip()}")
    return proc


def _docker(docker: str, *args: str, timeout: float = 600.0) -> str:
    return _docker_call(docker, *args, timeout=timeout).stdout.strip()


def remove_stale_containers(docker: str = "docker", root: str | None = None) -> list[str]:
    """Removes the containers of runs of this host under `root` (default `sandboxes_root()`) that
    no live process holds (see `remove_stale_sandboxes`); returns their ids. A run's lock lives
    under its own root, so containers of another root (another user or TMPDIR) are never judged."""
    root = root or sandboxes_root()
    listing = _docker(docker, "ps", "-a", "--filter", f"label={ROOT_LABEL}={root}",
                      "--format", f'{{{{.ID}}}} {{{{.Label "{RUN_LABEL}"}}}}')
    host = socket.gethostname() + "-"
    runs = [line.split(" ", 1) for line in listing.splitlines() if " " in line.strip()]
    stale = [cid for cid, run in runs if run.startswith(host) and run != RUN_ID and "/" not in run
             and _lock_is_free(os.path.join(root, run + ".lock"))]
    if stale:
        _docker(docker, "rm", "-f", *stale, timeout=120.0)
    return stale


_docker_cleaned: set[tuple[str, str]] = set()   # (docker CLI, root) whose stale containers this process removed
_docker_cleaned_lock = threading.Lock()          # sandboxes start in threads: one clean-up, the others wait
_docker_warned: set[str] = set()                 # daemon warnings already logged


# Capabilities a test suite running as root in its container may need to own and change its own
# files: Docker's default set minus raw sockets, mknod, chroot, audit, setpcap, low ports and file
# capabilities.
DOCKER_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID")


def docker_run_flags(limits: Limits, network: str, root: str | None = None) -> list[str]:
    """`docker run` flags of a sandbox container: the limits, no network unless asked for, no
    privileges beyond DOCKER_CAPS, an init, and the labels of this run (`RUN_ID`, and the sandboxes
    root that holds its lock) for clean-up.

    --init: PID 1 would otherwise be `sleep`, which never reaps, so every orphan (a background job
    of a command that ended or timed out) would stay a zombie, counted by --pids-limit, until no
    fork succeeds. --cpus in thousandths: the CLI refuses a value finer than a nano-CPU (2/3)."""
    return ["--init", "--network", network, "--memory", str(limits.memory_bytes),
            "--memory-swap", str(limits.memory_bytes), "--pids-limit", str(limits.processes),
            "--cpus", f"{limits.cpus:.3f}", "--ulimit", f"fsize={limits.file_bytes}", "--ulimit", "core=0",
            "--ulimit", f"nofile={limits.open_files}", "--security-opt", "no-new-privileges",
            "--cap-drop", "ALL", *[f"--cap-add={cap}" for cap in DOCKER_CAPS],
            "--label", f"{RUN_LABEL}={RUN_ID}", "--label", f"{ROOT_LABEL}={root or sandboxes_root()}"]


def _refuse_discarded_limits(stderr: str) -> None:
    """A daemon whose kernel lacks a cgroup (pids, memory) still starts the container, only warning
    that the limit was "discarded": a sandbox must not run without it. Other warnings (e.g. memory
    "limited without swap") are logged, once each."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if discarded := [line for line in lines if "discarded" in line.lower()]:
        raise SandboxError("the Docker daemon cannot enforce the sandbox's limits here: " + " ".join(discarded))
    for line in lines:
        if line.startswith("WARNING") and line not in _docker_warned:
            _docker_warned.add(line)
            logger.warning("docker run: %s", line)


class DockerSandbox(Sandbox):
    """A container of an official SWE-bench image; the repository is at /testbed.

    We drive the documented docker CLI through subprocess, as mini-swe-agent does, rather than the
    Python SDK: the same capped reader serves both sandboxes, and CLIs such as podman plug in.
    Timeouts: each command runs under coreutils `timeout` in the container, which (not in
    --foreground mode) signals its whole process group, TERM then KILL 5 s later, so background
    jobs die with a timed-out command; a host deadline 15 s later kills the `docker exec` client.
    Unlike the local sandbox, background jobs of a command that ENDS keep running, and setsid
    escapes timeouts, until `close()` removes the container; the container's init reaps them.
    `network="none"` unless a task needs one (e.g. "bridge"). `root`: the sandboxes folder whose
    run lock marks this run's containers as live (default `sandboxes_root()`).
    """

    def __init__(self, image: str, base_commit: str | None = None, *, workdir: str = "/testbed",
                 docker: str = "docker", network: str = "none", limits: Limits = Limits(),
                 root: str | None = None, ttl_s: int = 6 * 3600, env: dict[str, str] | None = None,
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES):
        self.workdir, self.docker, self.max_output_bytes = workdir, docker, max_output_bytes
        # SWE-bench images activate their conda env in /root/.bashrc; BASH_ENV makes `bash -c` read it
        self.env = {"BASH_ENV": "/root/.bashrc", **QUIET_ENV, **(env or {})}
        root = root or sandboxes_root()
        run_dir(root)   # holds this run's lock, so later runs see its containers as live
        with _docker_cleaned_lock:
            if (docker, root) not in _docker_cleaned:
                if removed := remove_stale_containers(docker, root):
                    logger.warning("removed %d containers of runs that are gone", len(removed))
                _docker_cleaned.add((docker, root))
        flags = docker_run_flags(limits, network, root)
        try:
            started = _docker_call(docker, "run", "-d", "--rm", "-w", workdir, *flags, image, "sleep", str(ttl_s))
        except SandboxError as e:
            raise SandboxError(f"could not start a container of {image} (flags, limits from `Limits`: "
                               f"{shlex.join(flags)}): {e}") from e
        self.container = started.stdout.strip()
        try:
            _refuse_discarded_limits(started.stderr)
            self.base_commit = base_commit or self._head()
        except BaseException:
            self.close()
            raise

    def _head(self) -> str:
        result = self.run("git rev-parse HEAD", 60.0)
        if result.returncode != 0:
            raise SandboxError(f"no git repository at {self.workdir}: {result.output.strip()}")
        return result.output.strip()

    def run(self, command, timeout, max_output_bytes=None, errors="replace") -> CommandResult:
        if "\0" in command:
            raise SandboxError("a command cannot contain a NUL byte (env.parse_action rejects it first)")
        env_flags = [flag for k, v in self.env.items() for flag in ("-e", f"{k}={v}")]
        argv = [self.docker, "exec", "-w", self.workdir, *env_flags, self.container,
                "timeout", "--kill-after=5", f"{timeout}s", "bash", "-c", command]
        start = time.monotonic()
        result = run_process(argv, timeout + 15.0, max_output_bytes or self.max_output_bytes, errors=errors)
        # `timeout` exits 124 after TERM, 137 after KILL; the elapsed time rules out a command's own 124
        result.timed_out |= result.returncode in (124, 137) and time.monotonic() - start >= timeout
        return result

    def write_file(self, name: str, text: str) -> str:
        path = f"/tmp/sandbox-files/{uuid.uuid4().hex[:8]}-{os.path.basename(name)}"
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
            f.flush()
            _docker(self.docker, "exec", self.container, "mkdir", "-p", "/tmp/sandbox-files")
            _docker(self.docker, "cp", f.name, f"{self.container}:{path}")
        return path

    def close(self) -> None:
        try:
            _docker(self.docker, "rm", "-f", self.container, timeout=120.0)
        except SandboxError as e:
            if "No such container" not in str(e):   # already gone (--rm after its ttl) is fine
                raise
