"""env.py: action parsing, and sandboxes under attack (timeouts, floods, escapes, network).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_sandbox.py

SAFETY: tests that try to get out (write outside the task dir, open connections, leave processes
behind) run ONLY in the bubblewrap sandbox (own PID and network namespaces) and skip without it.
Docker tests skip unless a daemon answers `docker info`.
"""
import os
import socket
import sys
import time
import tracemalloc
import uuid
import warnings

import pytest

from env import (SUBMIT_SENTINEL, CommandResult, DiffError, DockerSandbox, LocalSandbox, SandboxError,
                 docker_available, format_observation, is_submission, parse_action)


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "task"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (root / "README.md").write_text("a tiny repo\n")
    (root / "old.txt").write_text("to be deleted\n")
    return str(root)


@pytest.fixture
def sandbox(repo):
    """Whatever isolation this machine has; for harmless commands only."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        box = LocalSandbox(repo)
    yield box
    box.close()


@pytest.fixture
def isolated(repo):
    """The bwrap sandbox; commands that try to break out run only here."""
    try:
        box = LocalSandbox(repo, require_isolation=True)
    except SandboxError as e:
        pytest.skip(f"bubblewrap isolation unavailable: {e}")
    yield box
    box.close()


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
])
def test_parse_action_accepts_one_block(text, command):
    assert parse_action(text) == (command, None)


@pytest.mark.parametrize("text,found", [
    ("no block at all, just `ls`", "found 0"),
    ("```bash\nls\n```\nand\n```bash\npwd\n```", "found 2"),
    ("```bash\nls\n```\n```\npwd\n```", "found 2"),
    ("```bash\nls", "found 0"),                      # never closed
    ("```bash\n   \n```", "empty"),
])
def test_parse_action_rejects_bad_format(text, found):
    command, error = parse_action(text)
    assert command is None and found in error and "```bash" in error and SUBMIT_SENTINEL in error


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


@pytest.mark.parametrize("bwrap", ["bwrap", None], ids=["any-isolation", "no-isolation"])
def test_a_chatty_background_job_neither_holds_the_command_nor_survives_it(repo, bwrap):
    """Harmless without isolation: the job stays in the command's own process group."""
    marker = f"chatty-{uuid.uuid4().hex}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        box = LocalSandbox(repo, bwrap=bwrap)
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


def test_fallback_warns_loudly_and_still_runs(repo, caplog):
    for bwrap in ("/nonexistent/bwrap", "false"):   # missing, and present but not working
        with pytest.warns(UserWarning, match="NOT ISOLATED"):
            box = LocalSandbox(repo, bwrap=bwrap)
        with box:
            assert box.isolation == "none"
            assert box.run("echo hi", 5).output == "hi\n"
    assert any("NOT ISOLATED" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    with pytest.raises(SandboxError, match="isolation is required"):
        LocalSandbox(repo, bwrap="/nonexistent/bwrap", require_isolation=True)


# ---------------------------------------------------------------- git: base commit and diff

def test_base_commit_is_deterministic_and_checked(repo):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LocalSandbox(repo) as a, LocalSandbox(repo) as b:
            assert a.base_commit == b.base_commit and len(a.base_commit) == 40
        with pytest.raises(ValueError, match="base commit"):
            LocalSandbox(repo, base_commit="0" * 40)


def test_diff_captures_every_change_and_applies_to_a_fresh_copy(sandbox, repo):
    script = ("echo 'VALUE = 2' > pkg/mod.py && rm old.txt && mkdir -p new && echo hi > new/file.txt && "
              "printf 'bin\\x00\\xff' > new/blob.bin && chmod +x README.md && git add pkg/mod.py && "
              "git -c user.name=a -c user.email=a@b commit -qm 'agent commit' && "
              "echo 'VALUE = 3' > pkg/mod.py")
    assert sandbox.run(script, 10).returncode == 0
    patch = sandbox.diff()
    assert "GIT binary patch" in patch and "deleted file mode" in patch and "new mode 100755" in patch
    status = sandbox.run("git status --porcelain", 5).output
    assert " M pkg/mod.py\n" in status and "?? new/\n" in status   # the agent's index is untouched
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fresh = LocalSandbox(repo)
    with fresh:
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


def test_close_removes_everything(repo):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        box = LocalSandbox(repo)
    box.run("mkdir locked && touch locked/f && chmod 000 locked", 5)
    box.close()
    assert not os.path.exists(box.tmp)


# ---------------------------------------------------------------- escapes (bwrap only)

def test_writes_outside_the_task_dir_fail(isolated, repo):
    marker = f"escape-{uuid.uuid4().hex}"
    targets = ["/etc", os.path.expanduser("~"), repo, "/tmp", os.path.dirname(isolated.workdir)]
    command = "; ".join(f"echo x > {t}/{marker} && echo WROTE {t}" for t in targets)
    result = isolated.run(command, 10)
    assert "Read-only file system" in result.output
    for target in targets:
        assert not os.path.exists(os.path.join(target, marker)), target
    assert isolated.run(f"echo inside > {marker} && cat {marker}", 5).output == "inside\n"
    assert os.path.exists(os.path.join(isolated.workdir, marker))


def test_network_is_unreachable(isolated):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        probe = ("import socket\nfor addr in [('127.0.0.1', %d), ('1.1.1.1', 80)]:\n"
                 "    try:\n        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
                 "    except OSError as e:\n        print('BLOCKED', addr, e)\n") % port
        result = isolated.run(f"python - <<'EOF'\n{probe}EOF", 10)
        assert "CONNECTED" not in result.output and result.output.count("BLOCKED") == 2, result.output
        with pytest.raises(socket.timeout):
            server.accept()
    assert isolated.run("echo ok", 5).output == "ok\n"


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


def test_hidden_paths_are_empty_inside(repo, tmp_path):
    secret = tmp_path / "answers"
    secret.mkdir()
    (secret / "gold.patch").write_text("the answer\n")
    try:
        box = LocalSandbox(repo, require_isolation=True, hide=(str(secret),))
    except SandboxError as e:
        pytest.skip(f"bubblewrap isolation unavailable: {e}")
    with box:
        result = box.run(f"ls -A {secret}; cat {secret}/gold.patch", 5)
        assert "the answer" not in result.output and result.returncode != 0
    with pytest.raises(ValueError, match="hide"):
        LocalSandbox(repo, hide=(str(tmp_path / "nope"),))


# ---------------------------------------------------------------- docker

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
