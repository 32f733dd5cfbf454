"""sandbox.py and env.py: action parsing, and sandboxes under attack (timeouts, floods, limits,
escapes, network, stale runs).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_sandbox.py

SAFETY: every test that tries to get out runs ONLY in the bubblewrap sandbox and skips without it,
and each is harmless if it succeeds: it writes or reads a marker in a temporary folder of the test,
or signals a `sleep` the test started; limits are tried with a bounded amount just above them.
CI runs as root, so these tries are made as root. Docker tests run against a real daemon and a
local image (by default the built-in textkit task's, from tasks/swe/build_images.py); they skip
without them, except in CI (COMPACTIONRL_TEST_REQUIRE_DOCKER=1), where that is a failure.
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

from conftest import bwrap_isolates, require_docker_images
from env import MAX_COMMAND_BYTES, SUBMIT_SENTINEL, CommandResult, format_observation, is_submission, parse_action
from sandbox import (DOCKER_CAPS, ROOT_LABEL, RUN_ID, RUN_LABEL, DiffError, DockerSandbox, Limits, LocalSandbox,
                     SandboxError, check_docker_images, docker_run_flags, run_dir, sandboxes_root)
from swe_task import load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTKIT_IMAGE = next(r["image"] for r in load_tasks() if r["instance_id"] == "local__textkit-1")   # built-in


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
    python = os.path.join(os.path.realpath(sys.prefix), "bin", os.path.basename(sys.executable))   # our venv's
    assert f"HOME={sandbox.home}\n" in result.output and python in result.output
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


UNPRIVILEGED_CHECK = """
import os, sys
sys.path.insert(0, sys.argv[1])
from sandbox import LocalSandbox
with LocalSandbox(sys.argv[2], root=sys.argv[3]) as box:
    print(box.run("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; cat /etc/shadow; "
                  "unshare -Ur true || echo NO-USERNS; echo x > /usr/escape || echo NO-WRITE", 10).output)
"""


def test_as_a_user_other_than_root_the_same_holds(tmp_path):
    """The user-namespace path (bwrap run by a user, as on a laptop), tried as nobody from a root
    test: setpriv starts a system python as uid 65534 on a world-readable copy of a task."""
    if os.geteuid() != 0 or not bwrap_isolates() or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (to become nobody), bubblewrap and a system python3")
    if not all(os.stat(d).st_mode & 0o005 == 0o005 for d in (ROOT, os.path.dirname(ROOT))):
        pytest.skip(f"nobody cannot read this checkout ({ROOT})")
    shared = tempfile.mkdtemp(prefix="crl-nobody-", dir="/tmp")   # tmp_path is root's alone
    try:
        os.chmod(shared, 0o755)
        os.makedirs(task := os.path.join(shared, "task"))
        with open(os.path.join(task, "a.txt"), "w") as f:
            f.write("a\n")
        os.makedirs(root := os.path.join(shared, "sandboxes"))
        os.chown(root, 65534, 65534)
        result = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                 "/usr/bin/python3", "-c", UNPRIVILEGED_CHECK, ROOT, task, root],
                                capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        out = result.stdout
        assert result.returncode == 0, result.stderr
        assert out.split()[0] == "65534" and "CapEff:\t0000000000000000" in out and "CapBnd:\t0000000000000000" in out
        assert "NoNewPrivs:\t1" in out and "NO-USERNS" in out and "NO-WRITE" in out and "root:" not in out
    finally:
        shutil.rmtree(shared)


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
        "run": "ls -A /run /var/run /var /home", "host-tmp": f"cat {secret}",
        "gold": f"cat {ROOT}/tasks/swe/*/gold.patch {ROOT}/tasks/swe/tasks.jsonl",
        "git": f"git -C {ROOT} log -1", "docker-socket": "ls -l /var/run/docker.sock /run/docker.sock",
    }
    for name, command in probes.items():
        result = isolated.run(command, 5)
        assert result.returncode != 0 and "host secret" not in result.output, (name, result.output)
    listing = isolated.run(f"ls -A {ROOT}; ls -A /etc", 5).output.split()
    assert set(listing) & {"tasks", "train.py", ".git", "README.md", "shadow", "gshadow", "sudoers"} == set()
    assert "passwd" in listing and "hosts" in listing
    above = os.path.dirname(ROOT)   # it shows only the way to what is bound: our Python, the sandbox
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)} | {isolated.workdir, ROOT}
    ways = {os.path.relpath(p, above).split(os.sep)[0] for p in paths if p.startswith(above + os.sep)}
    assert set(isolated.run(f"ls -A {above}", 5).output.split()) <= ways
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
    """/proc/1/root, nsenter into pid 1's namespaces, ptrace of pid 1 (bwrap's init: the only
    process of the sandbox not the command's own; nothing outside is visible), and a kill of a host
    process (a `sleep` this test started) all fail from inside."""
    victim = subprocess.Popen(["sleep", "30"])
    try:
        ptrace = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                  "print('PTRACE', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n")   # PTRACE_ATTACH
        start = time.monotonic()
        result = isolated.run(f"cat /proc/1/root{marker_dir}/secret.txt; nsenter -t 1 -a true && echo ENTERED; "
                              f"kill -9 {victim.pid}; ls /proc | grep -qx {victim.pid} && echo SEEN; "
                              f"python - <<'EOF'\n{ptrace}EOF", 20)
        assert "host secret" not in result.output and "ENTERED" not in result.output, result.output
        assert "SEEN" not in result.output and "PTRACE -1 1\n" in result.output, result.output   # EPERM
        assert time.monotonic() - start < 10 and not result.timed_out
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


def test_disk_limit_counts_a_flood_of_empty_files(repo):
    """Empty files take no data blocks but do take inodes: each counts as 4 KiB, so 3000 of them
    pass an 8 MiB quota."""
    with isolated_sandbox(repo, limits=SMALL) as box:
        with pytest.raises(SandboxError, match="over its limit"):
            box.run("mkdir many && cd many && seq 3000 | xargs touch", 20)


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


def test_processes_starting_together_clean_up_stale_runs_without_tripping_on_each_other(tmp_path):
    """The ranks of one job start their first sandboxes at the same moment, each removing the runs
    a killed job left: every process starts, and every stale run is removed exactly once."""
    root = str(tmp_path / "sandboxes")
    for i in range(40):
        os.makedirs(os.path.join(root, f"gone-{i}", "sandbox-x", "repo", "pkg"))
        open(os.path.join(root, f"gone-{i}.lock"), "w").close()
    go = tmp_path / "go"
    script = (f"import os, sys, time; sys.path.insert(0, {ROOT!r}); import sandbox\n"
              f"while not os.path.exists({str(go)!r}): time.sleep(0.001)\n"
              f"sandbox.run_dir({root!r})\n")
    children = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
                for _ in range(4)]
    time.sleep(1.0)   # every child imported and waits
    go.touch()
    errors = [child.communicate(timeout=60)[1] for child in children]
    assert [child.returncode for child in children] == [0] * 4, errors
    assert not [name for name in os.listdir(root) if name.startswith("gone-")]
    assert sum(err.count("gone-") for err in errors) == 40, errors   # each removal logged once


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

def flag_values(flags: list[str], name: str) -> list[str]:
    return [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == name]


def test_docker_run_flags_are_secure_by_default():
    flags = docker_run_flags(Limits(), "none")
    pairs = {flag: flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag.startswith("--") and "=" not in flag}
    assert pairs["--network"] == "none" and pairs["--pids-limit"] == "512"
    assert pairs["--memory"] == pairs["--memory-swap"] == str(8 << 30)
    assert pairs["--cap-drop"] == "ALL" and pairs["--security-opt"] == "no-new-privileges"
    assert [f for f in flags if f.startswith("--cap-add")] == [f"--cap-add={cap}" for cap in DOCKER_CAPS]
    assert flag_values(flags, "--ulimit") == [f"fsize={2 << 30}", "core=0", "nofile=4096"]
    assert flag_values(flags, "--label") == [f"{RUN_LABEL}={RUN_ID}", f"{ROOT_LABEL}={sandboxes_root()}"]
    assert "--init" in flags and "--privileged" not in flags and pairs["--cpus"] == "2.000"
    assert flag_values(docker_run_flags(Limits(cpus=2 / 3), "none"), "--cpus") == ["0.667"]   # not "too precise"


def test_docker_sandbox_without_daemon_raises_clearly(tmp_path):
    """The real docker CLI, pointed at a daemon that is not there."""
    docker = tmp_path / "docker"
    docker.write_text(f"#!/bin/sh\nexec docker -H unix://{tmp_path}/no-daemon.sock \"$@\"\n")
    docker.chmod(0o755)
    with pytest.raises(SandboxError, match="docker.*(Cannot connect|daemon)"):
        DockerSandbox(TEXTKIT_IMAGE, docker=str(docker), root=str(tmp_path / "boxes"))
    with pytest.raises(SandboxError, match="needs a Docker daemon"):
        check_docker_images([TEXTKIT_IMAGE], docker=str(docker))


def fake_docker(folder, warning: str) -> str:
    """A docker CLI that prints `warning` when it starts a container, answers `exec` with a commit
    id, and logs its calls to <folder>/calls: the daemon of a kernel we do not have."""
    (folder / "warning").write_text(warning + "\n")
    path = folder / "docker"
    path.write_text(f"#!/bin/sh\necho \"$@\" >> {folder}/calls\ncase \"$1\" in\n"
                    f"  run) cat {folder}/warning >&2; echo fake-container;;\n"
                    f"  exec) echo {'0' * 40};;\nesac\n")
    path.chmod(0o755)
    return str(path)


def test_docker_sandbox_refuses_a_limit_the_daemon_discards(tmp_path):
    """A daemon without the pids cgroup starts the container anyway, only warning; the sandbox
    removes it and says which limit cannot hold."""
    warning = ("WARNING: Your kernel does not support pids limit capabilities or the cgroup is not "
               "mounted. PIDs limit discarded.")
    docker, root = fake_docker(tmp_path, warning), str(tmp_path / "sandboxes")
    with pytest.raises(SandboxError, match="cannot enforce the sandbox's limits here: .*PIDs limit discarded"):
        DockerSandbox("image", docker=docker, root=root)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith(f"ps -a --filter label={ROOT_LABEL}={root} ")   # only runs of this root are judged
    assert calls[-1] == "rm -f fake-container"


def test_docker_sandbox_logs_other_daemon_warnings_once(tmp_path, caplog):
    warning = f"WARNING: Memory limited without swap ({uuid.uuid4().hex})."
    docker = fake_docker(tmp_path, warning)
    for _ in range(2):
        with DockerSandbox("image", docker=docker, root=str(tmp_path / "sandboxes")) as box:
            assert box.base_commit == "0" * 40
    assert [r.getMessage() for r in caplog.records].count(f"docker run: {warning}") == 1


# Real-daemon tests. Each makes its own containers (removed at the end, whatever happens) and tries
# each limit with a bounded amount just above it, so a limit that failed costs the host little.

DOCKER_SMALL = Limits(processes=32, memory_bytes=128 << 20, file_bytes=1 << 20, open_files=64, cpus=1.0)
CAP_NUMBERS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7}


@pytest.fixture(scope="module")
def docker_image():
    """COMPACTIONRL_TEST_DOCKER_IMAGE or SWEBENCH_TEST_IMAGE (any image with bash, coreutils,
    python3, git and a git repository at /testbed, such as an official SWE-bench image), else the
    built-in textkit task's image; never pulled (conftest.require_docker_images)."""
    image = (os.environ.get("COMPACTIONRL_TEST_DOCKER_IMAGE") or os.environ.get("SWEBENCH_TEST_IMAGE")
             or TEXTKIT_IMAGE)
    require_docker_images([image])
    return image


@pytest.fixture
def container(docker_image):
    box = DockerSandbox(docker_image, limits=DOCKER_SMALL)
    yield box
    box.close()


def test_docker_commands_timeouts_output_and_diff(container, docker_image):
    """Fresh shells at /testbed; a timeout kills the command and its background job; a flood is
    capped, tail kept; diff() is the agent's change and applies in a fresh container."""
    box, marker = container, f"98{uuid.uuid4().int % 10**6}.25"
    assert box.run("pwd; cd /; export X=1", 30).output == "/testbed\n"
    assert box.run('pwd; echo "X=${X:-unset}"', 30).output == "/testbed\nX=unset\n"
    start = time.monotonic()
    slow = box.run(f"echo started; sleep {marker} & sleep 60", 2)
    assert slow.timed_out and "started" in slow.output and time.monotonic() - start < 10
    assert marker not in box.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '", 30).output
    flood = box.run("head -c 100000000 /dev/zero | tr '\\0' x; echo; echo THE-END", 60)
    assert flood.truncated and "100000009 bytes in total" in flood.output and flood.output.endswith("THE-END\n")
    assert len(flood.output) < box.max_output_bytes + 300
    edited = box.run("f=$(git ls-files | head -1); echo '# agent edit' >> \"$f\"; echo new > agent_new.txt; "
                     "echo \"$f\"", 30).output.strip()
    patch = box.diff()
    assert f"diff --git a/{edited} b/{edited}" in patch and "+# agent edit" in patch and "b/agent_new.txt" in patch
    with DockerSandbox(docker_image, limits=DOCKER_SMALL) as fresh:
        applied = fresh.run(f"git apply {fresh.write_file('agent.diff', patch)} && git status --porcelain", 30)
        assert applied.returncode == 0 and f" M {edited}\n" in applied.output and "?? agent_new.txt" in applied.output


def test_docker_orphans_are_reaped(container):
    """45 orphans against a limit of 32 processes: without an init as PID 1 (`sleep` never reaps)
    each would stay a zombie, counted by the pids limit, until no fork succeeds."""
    for _ in range(3):
        assert container.run("for i in $(seq 15); do (sleep 0.01 &); done; sleep 0.5", 30).returncode == 0
    zombies = container.run("grep -l '^State:.*Z' /proc/[0-9]*/status | wc -l", 30)
    assert zombies.output.strip() == "0", zombies.output
    assert container.run("echo forks", 30).output == "forks\n"


def test_docker_limits_hold(container):
    """40 processes against 32, 256 MiB against 128 (the kernel kills the process in the
    container's cgroup; the container goes on), 2 MiB against a 1 MiB file, 100 files against 64."""
    spawn = ("import subprocess\nstarted = []\nfor _ in range(40):\n    try:\n"
             "        started.append(subprocess.Popen(['sleep', '30']))\n    except OSError as e:\n"
             "        print('REFUSED', e)\n        break\nfor p in started:\n    p.kill()\n    p.wait()\n"
             "print('STARTED', len(started))\n")
    processes = container.run(f"python3 - <<'EOF'\n{spawn}EOF", 30).output
    assert "Resource temporarily unavailable" in processes and 20 < int(processes.split()[-1]) < 32, processes
    memory = container.run("python3 -c 'b = b\"x\" * (64 << 20); print(\"64 MiB\", \"ok\")'; "   # bash echoes
                           "python3 -c 'b = b\"x\" * (256 << 20); print(\"256 MiB\", \"ok\")'; echo rc=$?", 60).output
    assert "64 MiB ok" in memory and "256 MiB ok" not in memory and "rc=137" in memory, memory   # SIGKILL
    big = container.run("head -c 2097152 /dev/zero > /tmp/two; echo rc=$?; stat -c %s /tmp/two; rm /tmp/two", 30)
    # SIGXFSZ; bash may report the killed job before or after the next command's output
    assert "File size limit exceeded" in big.output and "rc=153\n" in big.output, big.output
    assert "\n1048576\n" in big.output, big.output   # the file stopped at the limit
    files = container.run("python3 -c 'fs = [open(\"/dev/null\") for _ in range(100)]' 2>&1 | tail -1", 30)
    assert "Too many open files" in files.output, files.output
    assert container.run("echo alive", 30).output == "alive\n"


def test_docker_has_no_network_not_even_the_hosts_loopback(container):
    """A port the test opens on every host address: unreachable from inside, and never connected."""
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(1)
    server.settimeout(0.5)
    try:
        port, addresses = server.getsockname()[1], ["127.0.0.1", "172.17.0.1"]   # loopback, docker0's host side
        try:
            addresses.append(socket.gethostbyname(socket.gethostname()))
        except OSError:   # a host name without an address
            pass
        probe = "; ".join(f"timeout 5 bash -c 'exec 3<>/dev/tcp/{a}/{port}' && echo CONNECTED || echo BLOCKED"
                          for a in addresses)
        result = container.run(f"{probe}; ls /sys/class/net", 60)
        assert "CONNECTED" not in result.output and result.output.count("BLOCKED") == len(addresses), result.output
        assert result.output.split()[-1] == "lo", result.output   # the only interface
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def test_docker_holds_only_the_file_owner_capabilities(container):
    status = container.run("grep -E '^(Cap|NoNewPrivs)' /proc/self/status", 30).output
    fields = dict(line.split(":\t") for line in status.splitlines())
    allowed = sum(1 << CAP_NUMBERS[cap] for cap in DOCKER_CAPS)
    assert int(fields["CapEff"], 16) == int(fields["CapPrm"], 16) == int(fields["CapBnd"], 16) == allowed, status
    assert int(fields["CapInh"], 16) == int(fields["CapAmb"], 16) == 0 and fields["NoNewPrivs"] == "1", status
    tries = container.run("mount -t tmpfs none /mnt && echo MOUNTED; unshare -Urm true && echo UNSHARED; "
                          "mount -o remount,ro / && echo REMOUNTED", 30)
    assert not {"MOUNTED", "UNSHARED", "REMOUNTED"} & set(tries.output.split()), tries.output


DOCKER_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[1])
from sandbox import DockerSandbox, Limits
with DockerSandbox(sys.argv[2], root=sys.argv[3], limits=Limits(processes=32, memory_bytes=128 << 20, cpus=1.0)) as box:
    print(box.container, flush=True)
    time.sleep(float(sys.argv[4]))
"""


def container_exists(container_id: str) -> bool:
    return subprocess.run(["docker", "inspect", container_id], capture_output=True).returncode == 0


def test_docker_containers_of_a_killed_run_are_removed_at_the_next_start(tmp_path, docker_image):
    """A real kill -9 of a process holding a container; the next run's first DockerSandbox removes
    that container and keeps the one of a run that still lives. Only this test's containers are
    judged: they carry its own sandboxes root."""
    root, made = str(tmp_path / "sandboxes"), []
    children = [subprocess.Popen([sys.executable, "-c", DOCKER_CHILD, ROOT, docker_image, root, "120"],
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        killed, live = (child.stdout.readline().strip() for child in children)
        made += [killed, live]
        children[0].kill()
        children[0].wait()
        assert container_exists(killed) and container_exists(live)
        next_run = subprocess.run([sys.executable, "-c", DOCKER_CHILD, ROOT, docker_image, root, "0"],
                                  capture_output=True, text=True, timeout=120)
        assert next_run.returncode == 0, next_run.stderr
        assert "removed 1 containers" in next_run.stderr and not container_exists(killed) and container_exists(live)
    finally:
        for child in children:
            child.kill()
            child.wait()
        for container_id in filter(None, made):
            subprocess.run(["docker", "rm", "-f", container_id], capture_output=True)
