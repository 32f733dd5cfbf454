"""eval_swebench.py: predictions in the official schema, the harness command, grading with swebench's
own functions on saved logs, local evaluation end to end (tiny model; scripted gold-patch agent),
resume, and errors that name the problem; docker mode end to end through the real harness on the
built-in tasks' locally built images (tasks/swe/build_images.py; skipped without them, except in
CI, where COMPACTIONRL_TEST_REQUIRE_DOCKER=1 makes that a failure).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_eval_swebench.py

tests/data holds a row (the built-in local__inventory-1 without repo_dir) and the test logs
swe_task.grade wrote for its gold patch (resolved) and for a README-only patch (unresolved,
tests/data/unresolved.patch): the eval script's `set -x` trace with the official markers
and the exit-code line that swebench 5 inserts, as in a harness test_output.txt.
"""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields, replace

import pytest

import eval_swebench as ev
import report
from conftest import bwrap_isolates, require_docker_images
from env import SUBMIT_SENTINEL
from model import build_tiny_model, load_tokenizer
from rollout import format_episode
from sandbox import SandboxError
from scripted import ScriptedAgent, gold_agent, gold_script, submit_script
from swe_task import BUILTIN_TASKS_FILE, load_tasks
from train import tiny_corpus

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
ROWS = {r["instance_id"]: r for r in load_tasks()}
A, B = "local__inventory-1", "local__textkit-1"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_model(path, tiny_corpus(), max_positions=8192)  # as eval_swebench builds its own: room for C + caps
    return path, load_tokenizer(path)


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny[1]


def gold_config(out_dir, ids, **kw):
    """Room for a whole patch in one action (the tiny tokenizer spends ~400 tokens on one)."""
    base = dict(instance_ids=ids, runs=1, max_compactions=(0,), max_turns=4, context_budget=4096, reserve=1024,
                max_action_tokens=1024, max_summary_tokens=64, workers=2, eval_timeout=60, out_dir=str(out_dir),
                allow_unisolated=not bwrap_isolates())
    return eval_config(**{**base, **kw})


def eval_config(**values):
    """ev.Config with knobs by their flag names: the agent loop's limits go to its rollout group."""
    limits = {f.name for f in fields(ev.EvalRollout)} - {"max_compactions"}
    rollout = replace(ev.Config().rollout, **{k: v for k, v in values.items() if k in limits})
    return ev.Config(rollout=rollout, **{k: v for k, v in values.items() if k not in limits})


# ---------------------------------------------------------------- local evaluation end to end

@pytest.fixture(scope="module")
def gold_run(tok, tmp_path_factory):
    """Resume: a first evaluation of A alone, then one of A and B in the same folder."""
    out = tmp_path_factory.mktemp("gold")
    first = gold_agent(tok, list(ROWS.values()))
    ev.main(gold_config(out, (A,)), engine=first, tokenizer=tok)
    with open(out / "K0" / "run0" / "preds.jsonl", encoding="utf-8") as f:
        after_first = f.read()
    second = gold_agent(tok, list(ROWS.values()))
    results = ev.main(gold_config(out, (A, B)), engine=second, tokenizer=tok)
    return out, first, second, after_first, results


def test_gold_agent_resolves_every_instance(gold_run):
    out, _, _, _, results = gold_run
    (stats,) = results[0]
    assert stats["pass@1"] == 1.0 and stats["resolved"] == 2 and stats["outcomes"] == {A: "resolved", B: "resolved"}
    assert stats["ended"] == {"submitted": 2} and stats["turns"] == 2 and stats["compactions"] == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["results"]["K0"][0]["pass@1"] == 1.0 and summary["model_name"] == ev.TINY_MODEL_NAME
    traj = (out / "K0" / "run0" / "trajectories" / f"{A}.txt").read_text()
    assert "ended: submitted" in traj and "reward 1.0" in traj and ROWS[A]["patch"].splitlines()[4] in traj
    assert "5 passed" in (out / "K0" / "run0" / "test_output" / f"{A}.txt").read_text()


def test_predictions_file_matches_the_official_schema(gold_run):
    from swebench.harness.utils import get_predictions_from_file
    out = gold_run[0]
    path = str(out / "K0" / "run0" / "preds.jsonl")
    preds = get_predictions_from_file(path, BUILTIN_TASKS_FILE, "test")
    assert [p["instance_id"] for p in preds] == [A, B]
    for p in preds:
        assert sorted(p) == ["instance_id", "model_name_or_path", "model_patch"]
        assert p["model_name_or_path"] == ev.TINY_MODEL_NAME
        # the sandbox's git diff, not the model's text: same change as the gold patch, git's own header
        patch, gold = p["model_patch"], ROWS[p["instance_id"]]["patch"]
        assert patch.startswith("diff --git a/") and patch.count("\n+") == gold.count("\n+") >= 1
        assert [ln for ln in patch.splitlines() if ln[:1] in "+-"] == [ln for ln in gold.splitlines() if ln[:1] in "+-"]


def test_resume_skips_instances_already_in_preds(gold_run):
    out, first, second, after_first, _ = gold_run
    assert set(first.seen) == {A} and set(second.seen) == {B}
    text = (out / "K0" / "run0" / "preds.jsonl").read_text()
    assert text.startswith(after_first) and len(text.splitlines()) == 2
    records = [json.loads(line) for line in (out / "K0" / "run0" / "episodes.jsonl").read_text().splitlines()]
    assert [r["instance_id"] for r in records] == [A, B] and all(r["resolved"] for r in records)


def test_tiny_model_end_to_end_both_settings(tiny, tmp_path, capsys):
    """The real HF engine and tiny model: ×1 and ×2 in one invocation; compaction can fire."""
    path, _ = tiny
    cfg = eval_config(model=path, instance_ids=(A, B), runs=1, max_compactions=(0, 1), max_turns=3,
                      context_budget=1024, reserve=96, max_action_tokens=48, max_summary_tokens=32, workers=2,
                      engine="hf", out_dir=str(tmp_path), allow_unisolated=not bwrap_isolates())
    results = ev.main(cfg)
    assert list(results) == [0, 1]
    for k, (stats,) in results.items():
        assert stats["instances"] == 2 and stats["pass@1"] == 0.0   # a random model fixes nothing
        assert 1 <= stats["turns"] <= 3 and stats["compactions"] <= k and sum(stats["ended"].values()) == 2
        run = tmp_path / f"K{k}" / "run0"
        assert sorted(os.listdir(run / "trajectories")) == [f"{A}.jsonl", f"{A}.txt", f"{B}.jsonl", f"{B}.txt"]
        assert len((run / "preds.jsonl").read_text().splitlines()) == 2
        for i in (A, B):  # the structured record holds the episode of the text file, token for token
            (rec,) = report.read_records(run / "trajectories" / f"{i}.jsonl")
            episode = format_episode(report.episode_from_record(rec), tiny[1].decode)
            assert (run / "trajectories" / f"{i}.txt").read_text().startswith(episode + "\n=== model_patch")
    page = (tmp_path / "report.html").read_text()
    assert "×2 run 0" in page and "/*REPORT_DATA*/" not in page
    # ~800 prompt tokens + 48-token actions: the window (1024) needs compacting within two turns
    assert results[0][0]["ended"].get("budget_exhausted") and results[1][0]["compactions"] > 0
    assert "[TRAIN summary]" in "".join(p.read_text() for p in (tmp_path / "K1" / "run0" / "trajectories").iterdir())
    table = capsys.readouterr().out
    assert "×1 " in table and "×2 " in table and "×2 − ×1: Pass@1 +0.000" in table


def test_unsubmitted_work_is_graded_only_when_asked(tok, tmp_path):
    """Gold fix, then turns run out before the submission: empty patch (the training rule), unless
    --grade-unsubmitted; an agent that deletes .git leaves no patch at all."""
    never_submits = ScriptedAgent(tok, list(ROWS.values()), lambda row, turn: gold_script(row, 0))
    (rule,) = ev.main(gold_config(tmp_path / "a", (A,), max_turns=1), engine=never_submits, tokenizer=tok)[0]
    assert rule["outcomes"] == {A: "empty_patch"} and rule["ended"] == {"max_turns": 1}
    traj = (tmp_path / "a" / "K0" / "run0" / "trajectories" / f"{A}.txt").read_text()
    assert "ended by max_turns without submitting" in traj and "diff --git a/inventory/store.py" in traj
    (harbor,) = ev.main(gold_config(tmp_path / "b", (A,), max_turns=1, grade_unsubmitted=True),
                        engine=never_submits, tokenizer=tok)[0]
    assert harbor["outcomes"] == {A: "resolved"}
    vandal = ScriptedAgent(tok, list(ROWS.values()), lambda row, turn: "rm -rf .git" if turn == 0 else
                           f"echo {SUBMIT_SENTINEL}")
    (broken,) = ev.main(gold_config(tmp_path / "c", (A,)), engine=vandal, tokenizer=tok)[0]
    assert broken["outcomes"] == {A: "empty_patch"} and broken["ended"] == {"submitted": 1}
    record = json.loads((tmp_path / "c" / "K0" / "run0" / "episodes.jsonl").read_text())
    assert "could not take the diff" in record["patch_error"]


# ---------------------------------------------------------------- grading on saved logs

def saved_row():
    with open(os.path.join(DATA, "swebench_row.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("log,patch_file,resolved", [
    ("test_output_resolved.txt", None, True),
    ("test_output_unresolved.txt", "unresolved.patch", False),
])
def test_swebench_grades_saved_logs(log, patch_file, resolved):
    from swebench.harness.grading import get_eval_report, get_logs_eval
    from swebench.harness.utils import make_test_spec
    row = saved_row()
    spec = make_test_spec(row)
    patch = open(os.path.join(DATA, patch_file)).read() if patch_file else row["patch"]
    status, found = get_logs_eval(spec, os.path.join(DATA, log))
    assert found and status[row["FAIL_TO_PASS"][0]] == ("PASSED" if resolved else "FAILED")
    pred = {"instance_id": row["instance_id"], "model_name_or_path": "m", "model_patch": patch}
    report = get_eval_report(spec, pred, os.path.join(DATA, log), include_tests_status=True)[row["instance_id"]]
    assert report["resolved"] is resolved and report["patch_successfully_applied"]
    assert report["tests_status"]["PASS_TO_PASS"]["success"] == row["PASS_TO_PASS"]


def test_reads_the_run_report_the_harness_writes(tmp_path, monkeypatch):
    """The docker path's report reading, on a report made by swebench's own run_instance (re-grading
    saved logs, no container) and make_run_report, under the harness's logs/ layout."""
    from swebench.harness.reporting import make_run_report
    from swebench.harness.run_evaluation import run_instance
    from swebench.harness.utils import make_test_spec
    monkeypatch.chdir(tmp_path)   # the harness writes logs/run_evaluation/... under the current folder
    row, model, run_id = saved_row(), "org/model", "run-1"
    rows = [row] + [dict(row, instance_id=i) for i in ("x__bad-1", "x__empty-1", "x__none-1")]
    patches = {row["instance_id"]: row["patch"], "x__bad-1": "diff", "x__empty-1": ""}   # x__none-1: no prediction
    preds = {i: {"instance_id": i, "model_name_or_path": model, "model_patch": p} for i, p in patches.items()}
    for iid, log in ((row["instance_id"], "test_output_resolved.txt"), ("x__bad-1", "test_output_unresolved.txt")):
        log_dir = tmp_path / "logs" / "run_evaluation" / run_id / "org__model" / iid
        log_dir.mkdir(parents=True)
        shutil.copy(os.path.join(DATA, log), log_dir / "test_output.txt")
        run_instance(make_test_spec(dict(row, instance_id=iid)), preds[iid], None, run_id, rewrite_reports=True)
    path = make_run_report(preds, rows, run_id, client=None, report_dir=str(tmp_path))
    assert str(path) == ev.report_path(str(tmp_path), model, run_id)
    outcome = ev.read_harness_report(path, [r["instance_id"] for r in rows])
    assert outcome == {row["instance_id"]: "resolved", "x__bad-1": "unresolved", "x__empty-1": "empty_patch",
                       "x__none-1": "incomplete"}


# ---------------------------------------------------------------- the harness command

def test_harness_command_is_exact_and_uses_only_flags_the_harness_has():
    argv = ev.harness_command(ev.VERIFIED, "test", "/o/preds.jsonl", "compactionrl-ab", ["a__b-1", "c__d-2"],
                              4, 1800, "/o")
    assert argv == [sys.executable, "-m", "swebench.harness.run_evaluation", "-d", "SWE-bench/SWE-bench_Verified",
                    "-s", "test", "-p", "/o/preds.jsonl", "-id", "compactionrl-ab", "--max_workers", "4",
                    "--timeout", "1800", "--report_dir", "/o", "-i", "a__b-1", "c__d-2"]
    usage = subprocess.run([sys.executable, "-m", "swebench.harness.run_evaluation", "--help"], capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 0, usage.stderr
    for flag in (a for a in argv[3:] if a.startswith("-")):   # argv[:3] = python -m module
        assert f"{flag} " in usage.stdout or f"{flag}," in usage.stdout, flag


def test_real_harness_accepts_our_command_and_predictions_up_to_the_daemon(gold_run, tmp_path, monkeypatch):
    """The real harness run on our preds.jsonl and the built-in rows, pointed at a daemon that is
    not there: it parses the argv, loads the predictions and the rows we wrote for it, writes its
    run metadata under run_dir, and stops at the missing daemon, which run_harness reports with
    the harness's own output."""
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(gold_run[0] / "K0" / "run0" / "preds.jsonl", run_dir / "preds.jsonl")
    with pytest.raises(RuntimeError, match=r"harness failed \(exit code 1.*harness.log") as e:
        ev.run_harness([ROWS[A], ROWS[B]], str(run_dir), ev.TINY_MODEL_NAME, 1, 60)
    msg = str(e.value)
    assert "DockerException" in msg and "unrecognized arguments" not in msg and "not found in dataset" not in msg
    run_id = ev.harness_run_id(str(run_dir), str(run_dir / "preds.jsonl"))
    assert (run_dir / "logs" / "run_evaluation" / run_id / "run.json").exists()
    assert [json.loads(line)["instance_id"] for line in (run_dir / "instances.jsonl").read_text().splitlines()] == [A, B]


def test_run_id_changes_with_the_predictions_and_the_folder(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "preds.jsonl").write_text('{"x": 1}\n')
    ids = {ev.harness_run_id(str(tmp_path / d), str(tmp_path / d / "preds.jsonl")) for d in ("a", "b")}
    assert len(ids) == 2
    before = ev.harness_run_id(str(tmp_path / "a"), str(tmp_path / "a" / "preds.jsonl"))
    (tmp_path / "a" / "preds.jsonl").write_text('{"x": 2}\n')
    assert ev.harness_run_id(str(tmp_path / "a"), str(tmp_path / "a" / "preds.jsonl")) != before


# ---------------------------------------------------------------- bad input

class NoEngine:
    def generate(self, *args):
        raise AssertionError("bad input must be refused before any episode runs")


def test_unknown_instance_id_is_named(tok, tmp_path):
    with pytest.raises(ValueError, match=r"unknown instance ids, not in .*tasks.jsonl: \['nope__x-1'\]"):
        ev.main(gold_config(tmp_path, (A, "nope__x-1")), engine=NoEngine(), tokenizer=tok)


def test_dataset_without_swebench5_columns_names_columns_dataset_and_fix(tok, tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({k: v for k, v in r.items() if k not in ("image", "eval_script")}) + "\n"
                           for r in ROWS.values()))
    with pytest.raises(ValueError) as e:
        ev.main(gold_config(tmp_path, (A,), dataset=str(old)), engine=NoEngine(), tokenizer=tok)
    msg = str(e.value)
    assert str(old) in msg and "eval_script (absent from 4 of 4 rows)" in msg
    assert "image" not in msg.split("needs:")[1].split(".")[0]   # derived, never missing
    assert "log_parser" not in msg.split("needs:")[1].split(".")[0]   # only the missing ones are listed
    assert "SWE-bench/SWE-bench_Verified" in msg and "swebench==4.1.0" in msg


def test_rows_without_a_repository_folder_are_refused_in_local_mode(tok, tmp_path):
    docker_rows = tmp_path / "docker.jsonl"
    docker_rows.write_text(json.dumps(saved_row()) + "\n")
    with pytest.raises(ValueError, match="have no repo_dir for a local sandbox.*--mode docker"):
        ev.main(gold_config(tmp_path, (), dataset=str(docker_rows)), engine=NoEngine(), tokenizer=tok)


def test_corrupt_or_foreign_predictions_are_named_by_file_and_line(tok, tmp_path):
    run = tmp_path / "K0" / "run0"
    run.mkdir(parents=True)
    good = {"instance_id": A, "model_name_or_path": ev.TINY_MODEL_NAME, "model_patch": ""}
    (run / "preds.jsonl").write_text(json.dumps(good) + '\n{"instance_id": "local__tex')   # cut off mid-write
    with pytest.raises(ValueError, match=r"preds.jsonl, line 2: not valid JSON"):
        ev.main(gold_config(tmp_path, (A, B)), engine=NoEngine(), tokenizer=tok)
    (run / "preds.jsonl").write_text(json.dumps(dict(good, model_name_or_path="other")) + "\n")
    with pytest.raises(ValueError, match=r"preds.jsonl, line 1: written for model 'other'"):
        ev.main(gold_config(tmp_path, (A, B)), engine=NoEngine(), tokenizer=tok)
    (run / "preds.jsonl").write_text(json.dumps({"instance_id": A}) + "\n")
    with pytest.raises(ValueError, match=r"preds.jsonl, line 1: expected an object with string fields"):
        ev.main(gold_config(tmp_path, (A, B)), engine=NoEngine(), tokenizer=tok)


def test_config_errors_explain_themselves(tok, tmp_path):
    with pytest.raises(AssertionError, match="not both"):
        ev.main(gold_config(tmp_path, (A,), n_instances=1), engine=NoEngine(), tokenizer=tok)
    with pytest.raises(AssertionError, match="each K once"):
        ev.main(gold_config(tmp_path, (A,), max_compactions=(3, 3)), engine=NoEngine(), tokenizer=tok)


def test_local_mode_refuses_to_run_unisolated_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr("sandbox.shutil.which", lambda name: None)   # as on a machine without bubblewrap
    monkeypatch.setattr(ev, "load_model", lambda cfg: pytest.fail("the model was loaded"))
    with pytest.raises(SandboxError, match="apt-get install bubblewrap.*--allow-unisolated"):
        ev.main(gold_config(tmp_path, (A,), allow_unisolated=False))


def test_random_subset_is_seeded_and_in_dataset_order():
    rows = list(ROWS.values())
    a = ev.select_instances(rows, n=2, seed=1)
    assert a == ev.select_instances(rows, n=2, seed=1) and len(a) == 2
    assert [r["instance_id"] for r in a] == [r["instance_id"] for r in rows if r in a]
    with pytest.raises(ValueError, match="--n-instances 9: the dataset has 4 instances"):
        ev.select_instances(rows, n=9)


# ---------------------------------------------------------------- docker: the built-in tasks' images

def docker_config(out_dir, **kw):
    return gold_config(out_dir, tuple(ROWS), mode="docker", dataset=BUILTIN_TASKS_FILE, workers=4,
                       harness_workers=2, **kw)


def test_docker_mode_grades_with_the_official_harness_on_locally_built_images(tok, tmp_path):
    """Every built-in task in its container (DockerSandbox), graded by the real harness on the
    images tasks/swe/build_images.py built: the gold agent resolves all, the agent that changes
    nothing none (empty patches, which the harness does not run)."""
    require_docker_images([r["image"] for r in ROWS.values()])
    (gold,) = ev.main(docker_config(tmp_path / "gold"), engine=gold_agent(tok, list(ROWS.values())),
                      tokenizer=tok)[0]
    assert gold["pass@1"] == 1.0 and gold["outcomes"] == {i: "resolved" for i in ROWS}, gold
    run = tmp_path / "gold" / "K0" / "run0"
    harness_log = (run / "harness.log").read_text()
    assert "Instances resolved: 4" in harness_log and "attempting to pull" not in harness_log.lower()
    for iid in ROWS:   # the harness's own log of the instance: its container, our image, pytest inside
        output = (run / "logs" / "run_evaluation").glob(f"*/*/{iid}/test_output.txt")
        assert "passed" in next(output).read_text()
    (empty,) = ev.main(docker_config(tmp_path / "empty"), engine=ScriptedAgent(tok, list(ROWS.values()),
                                                                               submit_script), tokenizer=tok)[0]
    assert empty["pass@1"] == 0.0 and empty["outcomes"] == {i: "empty_patch" for i in ROWS}, empty


def test_docker_mode_can_grade_in_the_projects_own_sandbox(tok, tmp_path):
    """--grader sandbox: the same verdicts as the harness (gold resolves every task, an empty patch
    none), graded by swe_task.grade in a DockerSandbox instead of the harness's CAP_SYS_ADMIN
    containers; nothing is handed to run_evaluation."""
    require_docker_images([r["image"] for r in ROWS.values()])
    (gold,) = ev.main(docker_config(tmp_path / "gold", grader="sandbox"),
                      engine=gold_agent(tok, list(ROWS.values())), tokenizer=tok)[0]
    assert gold["pass@1"] == 1.0 and gold["outcomes"] == {i: "resolved" for i in ROWS}, gold
    assert not (tmp_path / "gold" / "K0" / "run0" / "harness.log").exists()
    (empty,) = ev.main(docker_config(tmp_path / "empty", grader="sandbox"),
                       engine=ScriptedAgent(tok, list(ROWS.values()), submit_script), tokenizer=tok)[0]
    assert empty["pass@1"] == 0.0, empty


def test_a_model_whose_positions_end_before_the_longest_sequence_is_refused(tmp_path):
    path = build_tiny_model(str(tmp_path / "short"), tiny_corpus(), max_positions=2048)
    cfg = eval_config(model=path, context_budget=1024, reserve=96, max_action_tokens=48, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"3328 tokens .* past .*'s 2048 positions"):
        ev.load_model(cfg)
