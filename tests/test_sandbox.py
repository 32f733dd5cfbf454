"""sandbox.py and env.py: action parsing, and sandboxes under attack (timeouts, floods, limits,
escapes, network, stale runs).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_sandbox.py

SAFETY: every test that tries to get out runs ONLY in the bubblewrap sandbox and skips without it,
and each is harmless if it succeeds: it writes or reads a marker in a temporary folder of the test,
or signals a `sleep` the test started; limits are tried with a bounded amount just above them.
CI runs as root, so these tries are made as root. Docker tests skip unless a daemon answers.
"""
import ctypes
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid

import pytest

from conftest import bwrap_isolates
from env import MAX_COMMAND_BYTES, SUBMIT_SENTINEL, CommandResult, format_observation, is_submission, parse_action
from sandbox import (RUN_ID, RUN_LABEL, DiffError, DockerSandbox, Limits, LocalSandbox, SandboxError,
                     docker_available, docker_run_flags, run_dir)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "task"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (root / "README.md").write_text("a tiny repo\n")
    (root / "old.txt").write_text("to be deleted\n")
    return str(root)


@pytest.fixture
def sandbox(repo, sandbox_kwargs):
    """Whatever isolation this machine has; for harmless commands only."""
    box = LocalSandbox(repo, **sandbox_kwargs)
    yield box
    box.close()


def isolated_sandbox(repo, **kwargs):
    if not bwrap_isolates():
        pytest.skip("bubblewrap isolation unavailable")
    return LocalSandbox(repo, **kwargs)


@pytest.fixture
def isolated(repo):
    """The bwrap sandbox; commands that try to break out run only here."""
    box = isolated_sandbox(repo)
    yield box
    box.close()


@pytest.fixture
def marker_dir(tmp_path):
    """A host folder with a secret file: what an escape would read, and where it would write."""
    folder = tmp_path / f"host-{uuid.uuid4().hex}"
    folder.mkdir()
    (folder / "secret.txt").write_text("host secret\n")
    return folder


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (zombies have an empty one)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:   # the process ended while we looked
            continue
    return [pid for pid in pids if pid != os.getpid()]


def assert_gone(marker: str) -> None:
    deadline = time.monotonic() + 2.0
    while (pids := processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:   # clean up our own leftovers before failing
        os.kill(pid, 9)
    assert not pids, f"processes survived the command: {pids}"


# ---------------------------------------------------------------- parsing and observations

@pytest.mark.parametrize("text,command", [
    ("I will list.\n```bash\nls -la\n```\n", "ls -la"),
    ("```sh\necho a\necho b\n```", "echo a\necho b"),
    ("plain fence:\n```\npwd\n```", "pwd"),
    ("code first\n```python\nx = 1\n```\nthen\n```bash\nls\n```", "ls"),   # python block is not a command
    ("```bash\ncat <<'EOF' > f.md\n# a ```b``` c\nEOF\n```", "cat <<'EOF' > f.md\n# a ```b``` c\nEOF"),
    ("```bash  \nls\n```  \n", "ls"),
])
def test_parse_action_accepts_one_block(text, command):
    assert parse_action(text) == (command, None)


@pytest.mark.parametrize("text,found", [
    ("no block at all, just `ls`", "found 0"),
    ("```bash\nls\n```\nand\n```bash\npwd\n```", "found 2"),
    ("```bash\nls\n```\n```\npwd\n```", "found 2"),
    ("```bash\nls", "found 0"),                      # never closed
    ("```bash\n   \n```", "empty"),
    ("```bash\necho a\0b\n```", "NUL byte"),
    ("```bash\necho " + "x" * 200_000 + "\n```", f"at most {MAX_COMMAND_BYTES} fit"),
])
def test_parse_action_rejects_bad_format(text, found):
    command, error = parse_action(text)
    assert command is None and found in error and "```bash" in error and SUBMIT_SENTINEL in error


def test_parse_action_is_linear_in_the_action():
    """Many unclosed fences made the old whole-text regex quadratic (seconds at 40 KB). One pass
    over a 4 MB action must take well under a second; quadratic would take hours."""
    start = time.monotonic()
    for text in ("```bash\n" * 500_000, "```bash\nx\n" * 400_000, "x" * 4_000_000):
        assert parse_action(text)[0] is None
    assert time.monotonic() - start < 5


def test_submission_and_observation():
    assert is_submission(f"\n  {SUBMIT_SENTINEL}\nanything")
    assert not is_submission(f"warming up\n{SUBMIT_SENTINEL}")
    assert not is_submission("")
    shown = format_observation(CommandResult("partial\n", -9, timed_out=True, truncated=False))
    assert "<returncode>-9</returncode>" in shown and "time limit" in shown and "partial" in shown


# ---------------------------------------------------------------- harmless limits (any isolation)

def test_timeout_kills_the_group_and_the_next_command_works(sandbox):
    marker = f"98{uuid.uuid4().int % 10**6}.25"
    start = time.monotonic()
    result = sandbox.run(f"echo started; sleep {marker} & sleep 30", timeout=1.0)
    assert time.monotonic() - start < 4
    assert result.timed_out and result.returncode < 0 and "started" in result.output
    assert "time limit" in format_observation(result)
    assert_gone(marker)
    assert sandbox.run("echo still alive", 5).output == "still alive\n"


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "not-isolated"])
def test_a_chatty_background_job_neither_holds_the_command_nor_survives_it(repo, isolate):
    """Harmless without isolation: the job stays in the command's own process group."""
    marker = f"chatty-{uuid.uuid4().hex}"
    box = isolated_sandbox(repo) if isolate else LocalSandbox(repo, isolated=False)
    with box:
        start = time.monotonic()
        result = box.run(f": {marker}; (while :; do echo bg; sleep 0.005; done) & sleep 0.2; echo main", 10)
        assert time.monotonic() - start < 3 and not result.timed_out and "main" in result.output
        assert_gone(marker)


def test_100mb_of_output_is_capped_fast_and_in_bounded_memory(sandbox):
    tracemalloc.start()
    start = time.monotonic()
    result = sandbox.run("head -c 100000000 /dev/zero | tr '\\0' x; echo; echo THE-END", timeout=30)
    elapsed = time.monotonic() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert result.truncated and not result.timed_out and result.returncode == 0
    assert "output truncated" in result.output and "100000009 bytes" in result.output
    assert result.output.rstrip().endswith("THE-END")        # the tail is kept
    assert len(result.output) < sandbox.max_output_bytes + 300
    assert peak < 8 * 1024 * 1024, f"peak Python memory {peak} bytes"
    assert elapsed < 10
    assert sandbox.run("echo ok", 5).output == "ok\n"


def test_output_at_the_cap_is_exact_and_over_it_keeps_true_head_and_tail(sandbox):
    cap = sandbox.max_output_bytes
    exact = sandbox.run(f"head -c {cap} /dev/zero | tr '\\0' y", 10)
    assert exact.output == "y" * cap and not exact.truncated
    full = "".join(f"{i}\n" for i in range(1, 100001))   # what `seq 1 100000` prints, ~590 kB
    shown = sandbox.run("seq 1 100000", 10)
    head, marker_and_tail = shown.output.split("\n[... output truncated", 1)
    tail = marker_and_tail.split("...]\n", 1)[1]
    assert shown.truncated and f"{len(full)} bytes in total" in marker_and_tail
    assert len(head) + len(tail) == cap and full.startswith(head) and full.endswith(tail)


def test_binary_output_is_decoded_safely(sandbox):
    result = sandbox.run("printf 'ok\\xff\\xfe\\x00\\x80end'; head -c 4096 /dev/urandom", 5)
    assert result.returncode == 0 and result.output.startswith("ok\ufffd\ufffd\x00\ufffdend")
    assert sandbox.run("echo next", 5).output == "next\n"


def test_environment_is_minimal_and_python_works(sandbox, monkeypatch):
    monkeypatch.setenv("SECRET_TEST_TOKEN", "hunter2")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    result = sandbox.run("env; python -c 'import pytest, sys; print(sys.executable)'; "
                         "mkdir -p ~/.cache && echo x > ~/.cache/junk", 20)
    assert result.returncode == 0, result.output
    assert "hunter2" not in result.output and "proxy.invalid" not in result.output
    assert f"HOME={sandbox.home}\n" in result.output and sys.executable in result.output
    assert os.path.exists(os.path.join(sandbox.home, ".cache", "junk")) and sandbox.diff() == ""


def test_commands_run_in_fresh_subshells_in_the_repo(sandbox):
    assert sandbox.run("pwd", 5).output.strip() == sandbox.workdir
    sandbox.run("cd pkg && export X=1", 5)
    assert sandbox.run('pwd; echo "X=${X:-unset}"', 5).output == f"{sandbox.workdir}\nX=unset\n"


def test_without_isolation_it_refuses_unless_asked(repo, caplog):
    for bwrap in ("/nonexistent/bwrap", "false"):   # missing, and present but not working
        with pytest.raises(SandboxError, match="apt-get install bubblewrap") as error:
            LocalSandbox(repo, bwrap=bwrap)
        assert "--allow-unisolated" in str(error.value)
    with LocalSandbox(repo, isolated=False) as box:   # explicitly asked for
        assert box.isolation == "none" and box.run("echo hi", 5).output == "hi\n"
    assert any("NOT ISOLATED" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


# ---------------------------------------------------------------- git: base commit and diff

def test_base_commit_is_deterministic_and_checked(repo, sandbox_kwargs):
    with LocalSandbox(repo, **sandbox_kwargs) as a, LocalSandbox(repo, **sandbox_kwargs) as b:
        assert a.base_commit == b.base_commit and len(a.base_commit) == 40
    with pytest.raises(ValueError, match="base commit"):
        LocalSandbox(repo, base_commit="0" * 40, **sandbox_kwargs)


def test_diff_captures_every_change_and_applies_to_a_fresh_copy(sandbox, repo, sandbox_kwargs):
    script = ("echo 'VALUE = 2' > pkg/mod.py && rm old.txt && mkdir -p new && echo hi > new/file.txt && "
              "printf 'bin\\x00\\xff' > new/blob.bin && chmod +x README.md && git add pkg/mod.py && "
              "git -c user.name=a -c user.email=a@b commit -qm 'agent commit' && "
              "echo 'VALUE = 3' > pkg/mod.py")
    assert sandbox.run(script, 10).returncode == 0
    patch = sandbox.diff()
    assert "GIT binary patch" in patch and "deleted file mode" in patch and "new mode 100755" in patch
    status = sandbox.run("git status --porcelain", 5).output
    assert " M pkg/mod.py\n" in status and "?? new/\n" in status   # the agent's index is untouched
    with LocalSandbox(repo, **sandbox_kwargs) as fresh:
        path = fresh.write_file("p.diff", patch)
        assert fresh.run(f"git apply {path}", 10).returncode == 0
        tree = ("find . -path ./.git -prune -o -type f -print0 | sort -z | xargs -0 sha256sum; "
                "stat -c %A README.md")
        assert fresh.run(tree, 10).output == sandbox.run(tree, 10).output


def test_diff_of_an_untouched_repo_is_empty_and_broken_git_raises(sandbox):
    assert sandbox.diff() == ""
    sandbox.run("rm -rf .git", 5)
    with pytest.raises(DiffError, match="could not take the diff"):
        sandbox.diff()


def test_close_removes_locked_and_deeper_than_path_max_folders(repo, sandbox_kwargs):
    """An agent's chmod 000 and a folder chain past PATH_MAX (4096 bytes) must not make close()
    raise (it runs in the rollout's clean-up, for every episode)."""
    box = LocalSandbox(repo, **sandbox_kwargs)
    deep = "d" * 200
    made = box.run(f"mkdir locked && touch locked/f && chmod 000 locked; "
                   f"for i in $(seq 30); do mkdir {deep} && cd {deep} || exit 1; done; touch bottom; "
                   f"chmod 000 .", 20)
    assert made.returncode == 0, made.output
    box.close()
    assert not os.path.exists(box.tmp)


# ---------------------------------------------------------------- escapes (bwrap only, as root in CI)

def test_no_capability_and_no_way_to_regain_one(isolated):
    status = isolated.run("grep -E '^(Cap|NoNewPrivs)' /proc/self/status; id -u", 5).output
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert f"{field}:\t0000000000000000" in status, status
    if os.geteuid() == 0:   # as root, commands run as a uid of their own, never 0
        assert status.split()[-1] != "0" and "NoNewPrivs:\t1" in status
    # a new user namespace would give every capability back, over namespaces of its own
    nested = isolated.run("unshare -Urm sh -c 'echo NESTED; mount -t tmpfs none /usr && echo MOUNTED'; "
                          "python -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
                          "print(\"UNSHARE\", libc.unshare(0x10000000), ctypes.get_errno())'", 5)
    assert "NESTED" not in nested.output and "MOUNTED" not in nested.output, nested.output
    assert "Operation not permitted" in nested.output and "UNSHARE -1 1\n" in nested.output, nested.output


def test_read_only_mounts_cannot_be_remounted_or_undone(repo, marker_dir):
    """The one-line escape of the old sandbox: `mount -o remount,bind,rw /`, then a write. Here the
    target is a read-only host folder of the test's own; if a try got through, the write lands there."""
    box = isolated_sandbox(repo, read_only=(str(marker_dir),))
    with box:
        target = f"{marker_dir}/written-{uuid.uuid4().hex}"
        tries = [f"mount -o remount,bind,rw {marker_dir}", "mount -o remount,bind,rw /", "mount -o remount,rw /usr",
                 f"umount -l {marker_dir}", "umount -l /tmp", "umount /usr",
                 f"unshare -Urm sh -c 'mount -o remount,bind,rw {marker_dir}; echo x > {target}'",
                 f"unshare -Urm sh -c 'umount -l {marker_dir}; ls -A {marker_dir}'"]
        result = box.run("; ".join(tries) + f"; echo x > {target}; cat {marker_dir}/secret.txt", 20)
        assert not os.path.exists(target), result.output
        assert result.output.count("host secret") == 1, result.output   # still mounted, still read-only
        assert box.run(f"touch {target} || echo refused", 5).output.strip().endswith("refused")


def test_sees_only_what_a_task_needs(isolated, marker_dir):
    """From inside, as root: no shadow, nothing of /root but our Python, no other checkout or the
    project's gold patches, no /run, /var or host /tmp, the checkout's parent folders empty."""
    secret = marker_dir / "secret.txt"
    probes = {
        "shadow": "cat /etc/shadow", "root": "ls -A /root/.bashrc /root/.ssh /root/.cache",
        "run": "ls -A /run /var/run /var", "host-tmp": f"cat {secret}",
        "gold": f"cat {ROOT}/tasks/swe/*/gold.patch {ROOT}/tasks/swe/tasks.jsonl",
        "git": f"git -C {ROOT} log -1", "docker-socket": "ls -l /var/run/docker.sock /run/docker.sock",
    }
    for name, command in probes.items():
        result = isolated.run(command, 5)
        assert result.returncode != 0 and "host secret" not in result.output, (name, result.output)
    listing = isolated.run(f"ls -A {ROOT}; ls -A /etc", 5).output.split()
    assert set(listing) & {"tasks", "train.py", ".git", "README.md", "shadow", "gshadow", "sudoers"} == set()
    assert "passwd" in listing and "hosts" in listing
    parents = isolated.run(f"ls -A {os.path.dirname(ROOT)}", 5).output.split()
    assert parents == [os.path.basename(ROOT)] or os.path.dirname(sys.prefix) == os.path.dirname(ROOT)
    assert isolated.run("python -c 'import torch, transformers' && echo imports", 60).output == "imports\n"


def test_host_sockets_are_out_of_reach(isolated):
    """A Unix socket at a host path (as a Docker or database socket would be), an abstract one, and
    a loopback TCP port: none can be reached, and the listeners never see a connection."""
    folder = tempfile.mkdtemp(prefix="crl-", dir="/tmp")   # a socket path holds at most 107 bytes
    path, abstract = os.path.join(folder, "s.sock"), f"\0compactionrl-test-{uuid.uuid4().hex}"
    listeners = []
    for family, address in ((socket.AF_UNIX, path), (socket.AF_UNIX, abstract), (socket.AF_INET, ("127.0.0.1", 0))):
        server = socket.socket(family)
        server.bind(address)
        server.listen(1)
        server.settimeout(0.3)
        listeners.append((family, address if family == socket.AF_UNIX else server.getsockname(), server))
    try:
        probe = "import socket\n" + "".join(
            f"try:\n    s = socket.socket({int(family)}); s.settimeout(2); s.connect({address!r}); print('CONNECTED')\n"
            f"except OSError as e:\n    print('BLOCKED', e)\n" for family, address, _ in listeners)
        result = isolated.run(f"python - <<'EOF'\n{probe}EOF", 20)
        assert "CONNECTED" not in result.output and result.output.count("BLOCKED") == 3, result.output
        for _, _, server in listeners:
            with pytest.raises(socket.timeout):
                server.accept()
    finally:
        for _, _, server in listeners:
            server.close()
        shutil.rmtree(folder)


def test_no_way_into_the_host_through_proc_nsenter_or_ptrace(isolated, marker_dir):
    """/proc/1/root, nsenter into pid 1's namespaces, ptrace of pid 1 and of the shell's parent,
    and a kill of a host process (a `sleep` this test started) all fail from inside."""
    victim = subprocess.Popen(["sleep", "30"])
    try:
        ptrace = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  "for pid in (1, os.getppid()):\n"
                  "    print('PTRACE', pid, libc.ptrace(16, pid, 0, 0), os.strerror(ctypes.get_errno()))\n")
        result = isolated.run(f"cat /proc/1/root{marker_dir}/secret.txt; nsenter -t 1 -a true && echo ENTERED; "
                              f"kill -9 {victim.pid}; python - <<'EOF'\n{ptrace}EOF", 20)
        assert "host secret" not in result.output and "ENTERED" not in result.output, result.output
        assert result.output.count("PTRACE") == 2 and " 0 Success" not in result.output, result.output
        assert victim.poll() is None, "a host process was killed from inside the sandbox"
    finally:
        victim.kill()
        victim.wait()


def test_symlinks_out_of_the_task_copy_lead_nowhere(repo, marker_dir):
    """Links to host folders neither show them inside nor let clean-up touch them outside."""
    box = isolated_sandbox(repo)
    made = box.run(f"ln -s {marker_dir} out && ln -s / root-link && mkdir trap && ln -s {marker_dir} trap/in && "
                   f"chmod 000 trap; cat out/secret.txt", 5)
    assert "host secret" not in made.output
    mode = os.stat(marker_dir).st_mode
    box.close()
    assert (marker_dir / "secret.txt").read_text() == "host secret\n" and os.stat(marker_dir).st_mode == mode


def test_writes_outside_the_writable_folders_fail(isolated, repo, marker_dir):
    marker = f"escape-{uuid.uuid4().hex}"
    targets = ["/etc", "/usr", os.path.dirname(isolated.workdir), isolated.files, str(marker_dir), repo, "/"]
    result = isolated.run("; ".join(f"echo x > {t}/{marker}" for t in targets), 10)
    for target in targets[2:6]:
        assert not os.path.exists(os.path.join(target, marker)), target
    assert result.output.count("echo x") == 0 and result.returncode != 0
    assert isolated.run(f"echo inside > {marker} && cat {marker}", 5).output == "inside\n"
    assert os.path.exists(os.path.join(isolated.workdir, marker))


def test_network_is_unreachable(isolated):
    result = isolated.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\" "
                          "|| echo BLOCKED; ls /sys/class/net", 10)
    assert "BLOCKED" in result.output and "eth" not in result.output


def test_processes_outliving_the_command_die(isolated):
    marker = f"97{uuid.uuid4().int % 10**6}"
    command = (f"sleep {marker}.1 & setsid sleep {marker}.2 & nohup sleep {marker}.3 >/dev/null 2>&1 & "
               f"(trap '' HUP TERM; exec -a sleeper-{marker} sleep 1000) & disown -a; echo spawned")
    start = time.monotonic()
    result = isolated.run(command, 10)
    assert result.output == "spawned\n" and result.returncode == 0 and not result.timed_out
    assert time.monotonic() - start < 3
    assert_gone(marker)
    assert isolated.run("echo next", 5).output == "next\n"


# ---------------------------------------------------------------- limits (bwrap only; just above each)

SMALL = Limits(processes=32, memory_bytes=256 << 20, file_bytes=1 << 20, tmp_bytes=512 << 10,
               disk_bytes=8 << 20, open_files=64)


@pytest.fixture
def limited(repo):
    box = isolated_sandbox(repo, limits=SMALL)
    yield box
    box.close()


def test_process_limit(limited):
    """40 sleeps against a limit of 32 (threads count too): the forks past it fail."""
    spawn = ("import subprocess\nstarted = []\nfor _ in range(40):\n    try:\n"
             "        started.append(subprocess.Popen(['sleep', '5']))\n    except OSError as e:\n"
             "        print('REFUSED', e)\n        break\nprint('STARTED', len(started))\n")
    result = limited.run(f"python - <<'EOF'\n{spawn}EOF", 20)
    assert "Resource temporarily unavailable" in result.output, result.output
    assert 20 < int(result.output.split()[-1]) < 32, result.output
    assert limited.run("echo fine", 5).output == "fine\n"   # they all died with the command


def test_memory_file_size_and_open_files_limits(limited):
    memory = limited.run("python -c 'b = bytearray(64 << 20); print(\"64 MiB ok\")'; "
                         "python -c 'b = bytearray(300 << 20)' 2>&1 | tail -1", 20).output
    assert "64 MiB ok" in memory and "MemoryError" in memory
    big = limited.run("head -c 1048576 /dev/zero > one; head -c 2097152 /dev/zero > two; stat -c '%s %n' one two", 10)
    assert "File size limit exceeded" in big.output and "1048576 one\n1048576 two" in big.output
    files = limited.run("python -c 'fs = [open(\"/dev/null\") for _ in range(100)]' 2>&1 | tail -1", 10)
    assert "Too many open files" in files.output


def test_tmp_and_shm_are_small_and_private(limited):
    for folder in ("/tmp", "/dev/shm"):
        result = limited.run(f"head -c 1048576 /dev/zero > {folder}/fill; du -k {folder}/fill", 10)
        assert "No space left on device" in result.output and int(result.output.split()[-2]) <= 512
    assert "fill" not in limited.run("ls -A /tmp /dev/shm", 5).output   # each command gets fresh ones


def test_disk_limit_of_the_task_copy_and_home(limited):
    """Nine files of 1 MiB (each within the file limit) pass the 8 MiB of the copy and HOME."""
    with pytest.raises(SandboxError, match="over its limit"):
        limited.run("for i in $(seq 9); do head -c 1048576 /dev/urandom > f$i; done", 20)


# ---------------------------------------------------------------- stale runs

def test_sandboxes_of_a_killed_run_are_removed_at_the_next_start(tmp_path, repo, sandbox_kwargs):
    root = str(tmp_path / "sandboxes")
    os.makedirs(os.path.join(root, "gone-run", "sandbox-x", "repo"))
    open(os.path.join(root, "gone-run.lock"), "w").close()          # nobody holds it: the run is gone
    os.makedirs(os.path.join(root, "live-run", "sandbox-y"))
    live_lock = open(os.path.join(root, "live-run.lock"), "w")       # a run that still lives holds its lock
    fcntl.flock(live_lock, fcntl.LOCK_EX)
    try:
        with LocalSandbox(repo, root=root, **sandbox_kwargs) as box:
            assert box.tmp.startswith(run_dir(root)) and RUN_ID in box.tmp
        assert sorted(os.listdir(root)) == sorted([RUN_ID, RUN_ID + ".lock", "live-run", "live-run.lock"])
    finally:
        live_lock.close()


def test_a_killed_trainer_leaves_its_sandbox_for_the_next_start(tmp_path, repo, sandbox_kwargs):
    """A real kill -9 of a process that made a sandbox; a later start removes what it left."""
    root = str(tmp_path / "sandboxes")
    script = (f"import sys, time; sys.path.insert(0, {ROOT!r}); from sandbox import LocalSandbox\n"
              f"box = LocalSandbox({repo!r}, root={root!r}, **{sandbox_kwargs!r}); print(box.tmp, flush=True)\n"
              "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    left = child.stdout.readline().strip()
    child.kill()
    child.wait()
    assert os.path.isdir(left)
    LocalSandbox(repo, root=root, **sandbox_kwargs).close()
    assert not os.path.exists(os.path.dirname(left))


# ---------------------------------------------------------------- docker

def test_docker_run_flags_are_secure_by_default():
    flags = docker_run_flags(Limits(), "none")
    pairs = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--") and "=" not in flag}
    assert pairs["--network"] == "none" and pairs["--pids-limit"] == "512"
    assert pairs["--memory"] == pairs["--memory-swap"] == str(8 << 30)
    assert pairs["--cap-drop"] == "ALL" and pairs["--security-opt"] == "no-new-privileges"
    assert pairs["--label"] == f"{RUN_LABEL}={RUN_ID}" and "--privileged" not in flags
    assert f"fsize={2 << 30}" in flags and "--cpus" in flags


def test_docker_sandbox_without_daemon_raises_clearly():
    if docker_available():
        pytest.skip("a Docker daemon answers here")
    with pytest.raises(SandboxError, match="docker"):
        DockerSandbox("swebench/sweb.eval.x86_64.sympy_1776_sympy-20590:latest")


@pytest.mark.skipif(not docker_available(), reason="no Docker daemon answers `docker info`")
def test_docker_sandbox_round_trip():
    image = os.environ.get("SWEBENCH_TEST_IMAGE")
    if not image:
        pytest.skip("set SWEBENCH_TEST_IMAGE to an official SWE-bench image that is already pulled")
    with DockerSandbox(image) as box:
        assert box.run("pwd", 30).output.strip() == "/testbed"
        slow = box.run("echo started; sleep 60", 2)
        assert slow.timed_out and "started" in slow.output
        assert box.run("echo '# edit' >> README.md 2>/dev/null || echo '# edit' > NEW.md", 30).returncode == 0
        assert "# edit" in box.diff()
