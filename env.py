"""Sandboxes and the environment types every task shares.

Scaffold (mini-swe-agent's text style): each turn the policy writes its reasoning and exactly ONE
fenced shell block; it runs as `bash -c <command>` in a fresh subshell (`cd` and variables do not
persist); the observation is the exit code and the merged output; the agent submits by running a
command whose first output line is `SUBMIT_SENTINEL`.

Two sandboxes, one interface (`Sandbox`: `run`, `write_file`, `diff`, `close`, `workdir`):
* `LocalSandbox`: a temporary copy of a task's repository, made a git repository whose one commit
  is the base. Commands run under bubblewrap: read-only `/`, private `/dev`, `/proc`, `/tmp`, the
  copy and a private HOME the only writable paths, every namespace unshared (no network; own PID
  namespace, so all processes die with the command). Without a working bwrap: plain
  subprocesses, loudly warned (`isolation == "none"`).
* `DockerSandbox`: an official SWE-bench image, `docker run -d ... sleep`, then `docker exec`.

Where we depart from mini-swe-agent:
* Output is read incrementally and capped in BYTES (head and tail kept); theirs reads it all and
  then elides characters. A command printing 100 MB costs ~1.5x the cap in memory.
* Nothing outlives a command: when its shell exits, its process group (under bwrap: its PID
  namespace) is killed. Background servers must be started and used within one command.
* HOME is a private folder next to the copy, not the user's, so tool caches stay out of the diff.
* The submission is the sentinel alone; the patch is taken from the sandbox with git (`diff`),
  never from the model's text.
"""
from __future__ import annotations

import logging
import os
import re
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
DEFAULT_MAX_OUTPUT_BYTES = 64 * 1024    # what the agent sees of one command
DIFF_MAX_BYTES = 64 * 1024 * 1024        # a larger patch is an error, never silently truncated
DIFF_TIMEOUT_S = 120.0
COPY_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")   # caches never enter a copy


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the agent's command)."""


class DiffError(SandboxError):
    """No patch could be taken from the sandbox (e.g. the agent broke .git)."""


@dataclass
class Step:
    """What every environment's `step(action_text)` returns."""
    observation: str
    done: bool
    format_error: bool = False


@dataclass
class CommandResult:
    output: str        # stdout and stderr merged, capped (see `truncated`)
    returncode: int    # negative: killed by that signal (subprocess convention)
    timed_out: bool
    truncated: bool


# ---------------------------------------------------------------- actions and observations

# Any fenced block: an opening fence at a line start with an optional info word, the body, then the
# next line that is exactly a fence. Matching every language pairs fences correctly: the closing
# fence of a ```python block is never taken for an opening one. Command blocks are bash, sh, plain.
FENCED_BLOCK_RE = re.compile(r"^```([\w+-]*)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
COMMAND_LANGUAGES = ("bash", "sh", "")
FORMAT_HELP = ("Reply with your reasoning followed by exactly ONE shell command block, like this:\n\n"
               "```bash\n<command>\n```\n\n"
               f"When you are done, submit by running `echo {SUBMIT_SENTINEL}` as a command of its own.")


def parse_action(text: str) -> tuple[str | None, str | None]:
    """(command, None), or (None, a message telling the agent the expected format)."""
    blocks = [body for lang, body in FENCED_BLOCK_RE.findall(text) if lang in COMMAND_LANGUAGES]
    if len(blocks) != 1:
        return None, f"Format error: expected exactly one ```bash block, found {len(blocks)}.\n{FORMAT_HELP}"
    command = blocks[0].strip("\n")
    if not command.strip():
        return None, f"Format error: the command block is empty.\n{FORMAT_HELP}"
    return command, None


def is_submission(output: str) -> bool:
    """mini-swe-agent's convention: the output's first line is the sentinel."""
    lines = output.lstrip().splitlines()
    return bool(lines) and lines[0].strip() == SUBMIT_SENTINEL


def format_observation(result: CommandResult) -> str:
    warning = ("<warning>The command did not finish within its time limit and was killed. "
               "Avoid interactive or long-running commands.</warning>\n") if result.timed_out else ""
    return f"<returncode>{result.returncode}</returncode>\n{warning}<output>\n{result.output}</output>"


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
                cwd: str | None = None, errors: str = "replace") -> CommandResult:
    """Runs argv in a new session; stdout+stderr read incrementally into a capped buffer.

    When the process exits, or `timeout` passes, its whole process group is SIGKILLed, so its
    background children die with it. Then the pipe is drained only while data keeps coming: a
    process that escaped the group (setsid) cannot hold the call past its deadline.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
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
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-q", "-m", "base")):
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
    python_bin = os.path.dirname(sys.executable)   # our venv's python, so `python -m pytest` works
    return {"PATH": f"{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": home, "LANG": "C.UTF-8", "TMPDIR": "/tmp", "TERM": "dumb", **QUIET_ENV}


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


class LocalSandbox(Sandbox):
    """A temporary copy of `repo_dir`, commands under bubblewrap (see the module docstring).

    Under a fresh temp dir: `repo/` (`workdir`), `home/` (HOME: the only other writable path, so
    tool caches and dotfiles stay out of the diff) and `files/` (read-only to commands: what
    `write_file` wrote). Paths are the same inside and outside the sandbox.
    If the copy has no .git, it is committed as the base and must match `base_commit` if given;
    if it has one, `base_commit` (default HEAD) is checked out. `hide` lists host folders that
    commands see empty (e.g. the project, whose task files and git history hold gold patches);
    our venv stays visible even inside one.
    """

    def __init__(self, repo_dir: str, base_commit: str | None = None, *, root: str | None = None,
                 bwrap: str | None = "bwrap", require_isolation: bool = False, hide: tuple[str, ...] = (),
                 max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES):
        self.max_output_bytes, self.hide = max_output_bytes, tuple(os.path.abspath(p) for p in hide)
        if missing := [p for p in self.hide if not os.path.isdir(p)]:
            raise ValueError(f"hide: not existing directories: {missing}")
        self.tmp = tempfile.mkdtemp(prefix="sandbox-", dir=root)
        self.workdir, self.home, self.files = (os.path.join(self.tmp, d) for d in ("repo", "home", "files"))
        try:
            shutil.copytree(repo_dir, self.workdir, symlinks=True, ignore=COPY_IGNORE)
            os.mkdir(self.home)
            os.mkdir(self.files)
            self.base_commit = self._make_base(base_commit)
            self.isolation, self._prefix = self._choose_isolation(bwrap, require_isolation)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    def _make_base(self, base_commit: str | None) -> str:
        if os.path.isdir(os.path.join(self.workdir, ".git")):
            _host_git(self.workdir, "checkout", "-q", "--detach", "-f", base_commit or "HEAD")
            return _host_git(self.workdir, "rev-parse", "HEAD")
        made = commit_base(self.workdir)
        if base_commit is not None and made != base_commit:
            raise ValueError(f"the task's files give base commit {made}, but its row says {base_commit}: "
                             "the repository changed since the row was built")
        return made

    def _bwrap_argv(self, bwrap: str) -> list[str]:
        return [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                "--tmpfs", "/tmp",   # before the binds, which may lie under /tmp
                *[arg for path in self.hide for arg in ("--tmpfs", path)],
                *self._python_back(),
                "--bind", self.workdir, self.workdir, "--bind", self.home, self.home,
                "--ro-bind", self.files, self.files,
                "--unshare-all", "--die-with-parent", "--new-session", "--chdir", self.workdir, "--"]

    def _python_back(self) -> list[str]:
        """Binds our venv back (read-only) when a hidden folder or the private /tmp covers it (a
        checkout under /tmp, as CI may use), so `python` still works inside."""
        covered = [*self.hide, "/tmp"]
        hides_python = any(os.path.commonpath([sys.prefix, path]) == path for path in covered)
        return ["--ro-bind", sys.prefix, sys.prefix] if hides_python else []

    def _choose_isolation(self, bwrap: str | None, require: bool) -> tuple[str, list[str]]:
        path = shutil.which(bwrap) if bwrap else None
        if path is None:
            problem = f"the bubblewrap executable {bwrap!r} was not found"
        else:
            probe = run_process([*self._bwrap_argv(path), "true"], 10.0, 4096, env=sandbox_env(self.home))
            if probe.returncode == 0:
                return "bwrap", self._bwrap_argv(path)
            problem = f"bubblewrap does not work here (returncode {probe.returncode}): {probe.output.strip()}"
        if require:
            raise SandboxError(f"isolation is required but {problem}")
        message = (f"SANDBOX IS NOT ISOLATED: {problem}. Agent commands run as plain processes with full "
                   "access to this machine's files and network. Pass require_isolation=True to refuse.")
        warnings.warn(message, stacklevel=3)
        logger.warning(message)
        return "none", []

    def run(self, command, timeout, max_output_bytes=None, errors="replace") -> CommandResult:
        argv = [*self._prefix, "bash", "-c", command]
        return run_process(argv, timeout, max_output_bytes or self.max_output_bytes,
                           env=sandbox_env(self.home), cwd=self.workdir, errors=errors)

    def write_file(self, name: str, text: str) -> str:
        path = os.path.join(self.files, f"{uuid.uuid4().hex[:8]}-{os.path.basename(name)}")
        with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.write(text)
        return path

    def close(self) -> None:
        if not os.path.isdir(self.tmp):
            return
        for dirpath, dirnames, _ in os.walk(self.tmp):   # undo an agent's `chmod 000` before deleting
            for d in dirnames:
                if not os.path.islink(p := os.path.join(dirpath, d)):
                    os.chmod(p, 0o700)
        shutil.rmtree(self.tmp)


def docker_available(docker: str = "docker", timeout: float = 20.0) -> bool:
    """True when a Docker daemon answers `docker info`."""
    try:
        return subprocess.run([docker, "info"], capture_output=True, timeout=timeout).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return False


def _docker(docker: str, *args: str, timeout: float = 600.0) -> str:
    try:
        proc = subprocess.run([docker, *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise SandboxError(f"the docker CLI {docker!r} is not installed") from e
    if proc.returncode != 0:
        raise SandboxError(f"`{docker} {' '.join(args[:2])} ...` failed (a Docker daemon must answer "
                           f"`docker info`): {proc.stderr.strip()}")
    return proc.stdout.strip()


class DockerSandbox(Sandbox):
    """A container of an official SWE-bench image; the repository is at /testbed.

    We drive the documented docker CLI through subprocess, as mini-swe-agent does, rather than the
    Python SDK: the same capped reader serves both sandboxes, and CLIs such as podman plug in.
    Timeouts: each command runs under coreutils `timeout` in the container, which (not in
    --foreground mode) signals its whole process group, TERM then KILL 5 s later, so background
    jobs die with a timed-out command; a host deadline 15 s later kills the `docker exec` client.
    Unlike the local sandbox, background jobs of a command that ENDS keep running, and setsid
    escapes timeouts, until `close()` removes the container.
    """

    def __init__(self, image: str, base_commit: str | None = None, *, workdir: str = "/testbed",
                 docker: str = "docker", network: str | None = None, ttl_s: int = 6 * 3600,
                 env: dict[str, str] | None = None, max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES):
        self.workdir, self.docker, self.max_output_bytes = workdir, docker, max_output_bytes
        # SWE-bench images activate their conda env in /root/.bashrc; BASH_ENV makes `bash -c` read it
        self.env = {"BASH_ENV": "/root/.bashrc", **QUIET_ENV, **(env or {})}
        net = ["--network", network] if network else []
        self.container = _docker(docker, "run", "-d", "--rm", "-w", workdir, *net, image, "sleep", str(ttl_s))
        try:
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
