"""swe_task.py: the built-in tasks really grade (gold 1, anything else 0), rows are validated with
errors naming the row and field, and a scripted episode runs from reset to reward.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_swe_task.py

Each grade runs the task's real eval script with pytest in a fresh sandbox (~0.7 s).
"""
import copy
import json
import os
import shlex
import sys

import pytest

from conftest import bwrap_isolates
from env import SUBMIT_SENTINEL
from sandbox import SandboxError
from swe_task import (BUILTIN_TASKS_DIR, BUILTIN_TASKS_FILE, PROJECT_DIR, SWEEnv, apply_patch, check_local_rows,
                      grade, image_name, load_tasks, local_sandbox_factory, validate_row)
from tasks.swe.build_tasks import build_rows, render

ROWS = load_tasks()
IDS = [row["instance_id"] for row in ROWS]

# Per task, an edit that (after the gold fix) breaks a PASS_TO_PASS test but no FAIL_TO_PASS one.
BREAK_A_PASSING_TEST = {
    "local__textkit-1": ("textkit/strings.py", 'return "-".join(words)', 'return "_".join(words)'),
    "local__inventory-1": ("inventory/store.py", "if quantity > have:", "if quantity > have + 1:"),
    "local__statkit-1": ("statkit/summary.py", "max(values) - min(values)", "max(values) + min(values)"),
    "local__pathkit-1": ("pathkit/names.py", 'name.rfind(".")', 'name.find(".")'),
}


@pytest.fixture(scope="module")
def factory(sandbox_kwargs):
    return local_sandbox_factory(**sandbox_kwargs)


def replace_command(path: str, old: str, new: str) -> str:
    """A shell command that replaces `old` (exactly once) by `new` in `path`, as an agent would."""
    script = (f"import pathlib; p = pathlib.Path({path!r}); s = p.read_text(); "
              f"assert s.count({old!r}) == 1, 'edit target not found'; "
              f"p.write_text(s.replace({old!r}, {new!r}))")
    return f"python -c {shlex.quote(script)}"


def all_passed(report: dict, row: dict) -> bool:
    status = report["tests_status"]
    return (sorted(status["FAIL_TO_PASS"]["success"]) == sorted(row["FAIL_TO_PASS"])
            and sorted(status["PASS_TO_PASS"]["success"]) == sorted(row["PASS_TO_PASS"]))


def test_builtin_rows_are_current_and_cover_the_break_table():
    with open(BUILTIN_TASKS_FILE, encoding="utf-8") as f:
        assert f.read() == render(build_rows()), "run: python -m tasks.swe.build_tasks"
    assert 3 <= len(ROWS) <= 5 and set(IDS) == set(BREAK_A_PASSING_TEST)


# ---------------------------------------------------------------- every built-in task grades right

@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_gold_patch_resolves(row, factory):
    report = grade(row, row["patch"], factory, timeout=60)
    assert report["resolved"] and report["patch_applied"] and all_passed(report, row), report["log"]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_empty_patch_is_unresolved(row, factory):
    report = grade(row, "", factory)
    assert not report["resolved"] and not report["patch_applied"] and "empty patch" in report["log"]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_editing_only_the_visible_tests_is_unresolved(row, factory):
    """The hidden tests themselves, added to the visible test file: the eval script restores the
    file first, so this grades the unfixed code, which must fail every F2P and pass every P2P."""
    report = grade(row, row["test_patch"], factory, timeout=60)
    status = report["tests_status"]
    assert not report["resolved"] and report["patch_applied"]
    assert sorted(status["FAIL_TO_PASS"]["failure"]) == sorted(row["FAIL_TO_PASS"]), report["log"]
    assert sorted(status["PASS_TO_PASS"]["success"]) == sorted(row["PASS_TO_PASS"]), report["log"]


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_fix_that_breaks_a_passing_test_is_unresolved(row, factory):
    with factory(row) as sandbox:   # the agent's side: gold fix, then the breaking edit, then git diff
        assert apply_patch(sandbox, row["patch"])[0]
        edit = sandbox.run(replace_command(*BREAK_A_PASSING_TEST[row["instance_id"]]), 20)
        assert edit.returncode == 0, edit.output
        patch = sandbox.diff()
    report = grade(row, patch, factory, timeout=60)
    status = report["tests_status"]
    assert not report["resolved"] and status["PASS_TO_PASS"]["failure"], report["log"]
    assert sorted(status["FAIL_TO_PASS"]["success"]) == sorted(row["FAIL_TO_PASS"]), report["log"]


def test_patch_that_does_not_apply_is_unresolved(factory):
    bad = "diff --git a/nosuch.py b/nosuch.py\n--- a/nosuch.py\n+++ b/nosuch.py\n@@ -1 +1 @@\n-x\n+y\n"
    report = grade(ROWS[0], bad, factory)
    assert not report["resolved"] and not report["patch_applied"] and "Patch Apply Failed" in report["log"]


def test_eval_that_times_out_is_unresolved(factory):
    """Even with the gold patch: a timed-out run is marked as the harness marks it, and fails."""
    row = dict(ROWS[0])
    row["eval_script"] = row["eval_script"].replace("python -m pytest", "sleep 30; python -m pytest")
    report = grade(row, row["patch"], factory, timeout=1)
    assert not report["resolved"] and "Tests Timed Out" in report["log"]


# ---------------------------------------------------------------- malformed rows

def bad_row(**changes) -> dict:
    row = copy.deepcopy(ROWS[0])
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


@pytest.mark.parametrize("row,field,problem", [
    (bad_row(eval_type=None), "eval_type", "is missing"),
    (bad_row(FAIL_TO_PASS='["tests/a.py::t", '), "FAIL_TO_PASS", "not valid JSON"),
    (bad_row(PASS_TO_PASS=[1, 2]), "PASS_TO_PASS", "list of test ids"),
    (bad_row(log_parser="parse_log_nosuch"), "log_parser", "not one of swebench's parsers"),
    (bad_row(eval_type="most"), "eval_type", "expected one of"),
    (bad_row(eval_script="pytest"), "eval_script", "markers"),
    (bad_row(version=0.1), "version", "must be a str"),
    (bad_row(repo_dir=3), "repo_dir", "must be a folder"),
])
def test_malformed_rows_name_the_row_and_field(row, field, problem):
    named = f"task row 7 \\(instance_id='{row['instance_id']}'\\): field '{field}'"
    with pytest.raises(ValueError, match=named) as e:
        validate_row(row, 7)
    assert problem in str(e.value)


def test_load_tasks_names_the_bad_row_in_a_file(tmp_path):
    good = {k: v for k, v in ROWS[0].items() if k != "repo_dir"}
    good["repo_dir"] = "x"
    rows = [dict(good, instance_id="a"), dict(good, instance_id="b", FAIL_TO_PASS="{not json")]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"task row 1 \(instance_id='b'\): field 'FAIL_TO_PASS'"):
        load_tasks(str(path))
    path.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="'repo_dir' points to .*x, which is not a folder"):
        load_tasks(str(path))
    (tmp_path / "x").mkdir()
    path.write_text(2 * (json.dumps(rows[0]) + "\n"))
    with pytest.raises(ValueError, match="rows 0 and 1 share instance_id 'a'"):
        load_tasks(str(path))
    json_path = tmp_path / "tasks.json"
    json_path.write_text(json.dumps([rows[0]]))
    assert load_tasks(str(json_path))[0]["FAIL_TO_PASS"] == ROWS[0]["FAIL_TO_PASS"]


def test_load_tasks_reads_parquet_like_jsonl(tmp_path):
    pandas = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = str(tmp_path / "tasks.parquet")
    pandas.DataFrame(ROWS).to_parquet(path)   # absolute repo_dir: joining keeps it as is
    assert load_tasks(path) == ROWS


def verified_style_rows():
    """Two rows of our own in SWE-bench Verified's columns, as its Hugging Face dataset has them:
    FAIL_TO_PASS/PASS_TO_PASS as JSON text, hints and dates, no repo_dir, and here no image."""
    rows = []
    for i, row in enumerate(ROWS[:2]):
        rows.append({"repo": "acme/widgets", "instance_id": f"acme__widgets-{100 + i}",
                     "base_commit": row["base_commit"], "patch": row["patch"], "test_patch": row["test_patch"],
                     "problem_statement": row["problem_statement"], "hints_text": "",
                     "created_at": "2024-01-0{}T00:00:00Z".format(i + 1), "version": "1.0",
                     "FAIL_TO_PASS": json.dumps(row["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(row["PASS_TO_PASS"]),
                     "environment_setup_commit": row["base_commit"], "difficulty": "<15 min fix",
                     "eval_script": row["eval_script"], "log_parser": row["log_parser"], "eval_type": row["eval_type"]})
    return rows


def test_swe_bench_rows_load_alike_from_a_file_and_through_datasets(tmp_path):
    """The same rows as a .jsonl, a .parquet, a Hugging Face dataset folder (<split>.parquet) and a
    `save_to_disk` folder, the last two read through `datasets` (swebench's own loader): the same
    validated rows, each with the image name the harness derives for a published instance."""
    from datasets import Dataset
    from swebench.task.checks import expected_image
    rows = verified_style_rows()
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "hub").mkdir()
    Dataset.from_list(rows).to_parquet(str(tmp_path / "hub" / "test.parquet"))
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk" / "test"))
    Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    loaded = {name: load_tasks(str(tmp_path / name), "test") for name in ("rows.jsonl", "rows.parquet", "hub", "disk")}
    first = loaded["rows.jsonl"]
    assert all(rows == first for rows in loaded.values())
    assert [r["image"] for r in first] == [expected_image(r["instance_id"]) for r in rows] == \
        ["swebench/sweb.eval.x86_64.acme_1776_widgets-100:latest", "swebench/sweb.eval.x86_64.acme_1776_widgets-101:latest"]
    assert first[0]["FAIL_TO_PASS"] == ROWS[0]["FAIL_TO_PASS"] and first[1]["hints_text"] == ""
    assert image_name("acme__widgets-100", namespace=None) == "sweb.eval.x86_64.acme__widgets-100:latest"
    with pytest.raises(ValueError, match="have no repo_dir for a local sandbox"):
        check_local_rows(first, "rows.jsonl")
    check_local_rows(ROWS, "the built-in tasks")


# ---------------------------------------------------------------- transient failures

def test_a_sandbox_that_fails_to_start_or_grade_is_retried_a_bounded_number_of_times(factory, monkeypatch):
    """A container start or a grading that fails with SandboxError is tried again (3 attempts in
    all); a failure on every attempt propagates, and the rollout ends that episode as env_error."""
    monkeypatch.setattr("swe_task.time.sleep", lambda s: None)
    row, calls = ROWS[0], []

    def flaky(fail_times):
        def make(r):
            calls.append(r["instance_id"])
            if len(calls) <= fail_times:
                raise SandboxError("docker daemon hiccup")
            return factory(r)
        return make

    env = SWEEnv(row, flaky(2))
    env.reset()   # third attempt starts
    try:
        assert len(calls) == 3 and env.step(act(f"echo {SUBMIT_SENTINEL}")).done
    finally:
        env.close()
    calls.clear()
    with pytest.raises(SandboxError, match="hiccup"):
        SWEEnv(row, flaky(3)).reset()
    assert len(calls) == 3
    graded = []
    monkeypatch.setattr("swe_task.grade", lambda *a: graded.append(1) or (_ for _ in ()).throw(SandboxError("grader")))
    env = SWEEnv(row, factory)
    env.reset()
    try:
        env.step(act("echo change >> README.md"))
        with pytest.raises(SandboxError, match="grader"):
            env.reward()
        assert len(graded) == 3
    finally:
        env.close()


# ---------------------------------------------------------------- a scripted episode

def act(command: str) -> str:
    return f"Next step.\n```bash\n{command}\n```"


def test_scripted_episode_fixes_the_bug_and_earns_reward_1(factory):
    row = next(r for r in ROWS if r["instance_id"] == "local__textkit-1")
    env = SWEEnv(row, factory, command_timeout=30)
    messages = env.reset()
    assert [m["role"] for m in messages] == ["system", "user"]
    assert row["problem_statement"] in messages[1]["content"] and SUBMIT_SENTINEL in messages[0]["content"]
    try:
        seen = env.step(act("cat textkit/strings.py"))
        assert not seen.done and not seen.format_error and "if len(text) < limit:" in seen.observation
        oops = env.step("I think I should edit the file now, without a command block.")
        assert oops.format_error and not oops.done and "exactly one" in oops.observation
        fixed = env.step(act("sed -i 's/if len(text) < limit:/if len(text) <= limit:/' textkit/strings.py"))
        assert "<returncode>0</returncode>" in fixed.observation
        tests = env.step(act("python -m pytest -q -p no:cacheprovider tests"))
        assert "<returncode>0</returncode>" in tests.observation and not tests.done
        done = env.step(act(f"echo {SUBMIT_SENTINEL}"))
        assert done.done and not done.format_error
        assert "if len(text) <= limit:" in env.diff()
        assert env.reward() == 1.0 and env.last_grade["resolved"]
        with pytest.raises(RuntimeError, match="episode is over"):
            env.step(act("ls"))
    finally:
        env.close()
    assert env.sandbox is None


def test_episode_without_a_fix_or_with_broken_git_earns_0(factory):
    env = SWEEnv(ROWS[0], factory)
    env.reset()
    try:
        assert env.step(act(f"echo {SUBMIT_SENTINEL}")).done
        assert env.reward() == 0.0 and "empty patch" in env.last_grade["log"]
        env.reset()
        env.step(act("rm -rf .git"))
        assert env.reward() == 0.0 and "could not take the diff" in env.last_grade["log"]
    finally:
        env.close()


def test_agent_cannot_read_the_task_files(factory):
    """The project (tasks, git history) is hidden; only our venv stays, and python still works."""
    if not bwrap_isolates():
        pytest.skip("bubblewrap isolation unavailable")
    env = SWEEnv(ROWS[0], factory)
    env.reset()
    try:
        peek = env.step(act(f"cat {BUILTIN_TASKS_DIR}/tasks.jsonl; "
                            f"git -C {PROJECT_DIR} log -p | grep 'diff --git'"))
        assert "No such file" in peek.observation and "diff --git" not in peek.observation
        listing = env.sandbox.run(f"ls -A {PROJECT_DIR}", 5)
        # at most the venv, when it lives in the checkout (one linked from elsewhere is bound there)
        assert listing.returncode != 0 or set(listing.output.split()) <= {os.path.basename(sys.prefix)}, \
            listing.output
        tests = env.step(act("python -m pytest -q -p no:cacheprovider tests"))
        assert "<returncode>0</returncode>" in tests.observation
    finally:
        env.close()
