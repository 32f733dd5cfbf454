"""The run folder is safe: a run never destroys or mixes another, bad input stops it with an error
naming the folder, file, line or flag before any model is loaded, and damaged checkpoints or
metrics are caught (rundir.py, fsdp's checkpoint section, metrics.py, swe_task.load_tasks).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_run_dir.py
"""
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import rundir
from metrics import Logger, json_line, plot_curve, read_metrics
from model import build_tiny_model, load_policy
from swe_task import load_tasks
from tests.test_train import ROOT, SMALL
from train import tiny_corpus

BWRAP = shutil.which("bwrap")
needs_bwrap = pytest.mark.skipif(BWRAP is None, reason="bubblewrap (bwrap) is not installed")


def train_py(args, ok=True, prefix=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run([*prefix, sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert (p.returncode == 0) == ok, f"{' '.join(args)}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


# --- the folder: refuse, overwrite, config, probe -------------------------------------------------

@pytest.mark.parametrize("marker", rundir.RUN_MARKERS)
def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path, marker):
    assert rundir.prepare_out_dir(str(tmp_path / "new"), resume=False, overwrite=False) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert rundir.prepare_out_dir(str(tmp_path), resume=False, overwrite=False) == []  # no run here yet
    if marker == "checkpoints":
        (tmp_path / marker).mkdir()
    else:
        (tmp_path / marker).write_text("{}\n")
    with pytest.raises(FileExistsError, match=f"{tmp_path} already holds a run .*--resume.*--overwrite"):
        rundir.prepare_out_dir(str(tmp_path), resume=False, overwrite=False)
    assert rundir.prepare_out_dir(str(tmp_path), resume=True, overwrite=False) == []
    assert (tmp_path / marker).exists()


def test_overwrite_removes_only_what_train_py_writes(tmp_path):
    artifacts = ["metrics.jsonl", "metrics.jsonl.tmp", "config.json", "samples_step00000.txt",
                 "samples_step00010.txt", "curve.png"]
    folders = ["checkpoints/step_00000001", "hf", "hf_step_9", "tiny_model", "tb", "tiny_model.tmp"]
    others = ["notes.txt", "hf_notes.txt", "samples.txt", "log.txt", "hf_backup/model.safetensors"]
    for name in artifacts + [f + "/x" for f in folders] + others:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    removed = rundir.prepare_out_dir(str(tmp_path), resume=False, overwrite=True)
    assert sorted(removed) == sorted(artifacts + [f.split("/")[0] for f in folders])
    assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", "hf_notes.txt", "samples.txt", "log.txt", "hf_backup"])
    assert (tmp_path / "hf_backup" / "model.safetensors").read_text() == "x"
    assert rundir.prepare_out_dir(str(tmp_path), resume=False, overwrite=False) == []  # now free


def test_resume_and_overwrite_together_are_refused():
    from config import finalize, make
    with pytest.raises(AssertionError, match="--resume .* --overwrite"):
        finalize(make(resume=True, overwrite=True, rollouts_per_step=8), 1)


def test_config_json_is_replaced_whole(tmp_path):
    from config import flat, make
    cfg = flat(make(out_dir=str(tmp_path), seed=3))
    rundir.write_config(str(tmp_path), cfg)
    assert json.loads((tmp_path / "config.json").read_text()) == cfg
    rundir.write_config(str(tmp_path), {**cfg, "seed": 4})  # --resume rewrites it
    assert json.loads((tmp_path / "config.json").read_text())["seed"] == 4
    assert os.listdir(tmp_path) == ["config.json"]  # no temporary file left


def test_probe_names_the_folder_it_cannot_write(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match=f"cannot write to the run folder {tmp_path / 'a_file' / 'run'} "
                                      r"\(Not a directory"):
        rundir.probe_writable(str(tmp_path / "a_file" / "run"))
    rundir.probe_writable(str(tmp_path / "new" / "run"), ".probe_rank0")
    assert os.listdir(tmp_path / "new" / "run") == []  # created, probed, left empty


@needs_bwrap
def test_probe_fails_on_a_read_only_mount_and_on_a_full_disk(tmp_path):
    """Real mounts, private to the process: bubblewrap binds tmp_path read-only, then mounts a
    one-page tmpfs that a filler file makes full."""
    code = ("import rundir, sys\n"
            "if len(sys.argv) > 2:\n"
            "    try:\n"
            "        open(sys.argv[2], 'wb').write(b'x' * 65536)\n"
            "    except OSError:\n"
            "        pass  # filled up: what the probe must now find\n"
            "rundir.probe_writable(sys.argv[1])\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    ro = subprocess.run([BWRAP, "--dev-bind", "/", "/", "--ro-bind", str(tmp_path), str(tmp_path),
                         sys.executable, "-c", code, str(tmp_path / "run")], env=env, capture_output=True, text=True)
    assert f"cannot write to the run folder {tmp_path / 'run'} (Read-only file system" in ro.stderr, ro.stderr
    full = subprocess.run([BWRAP, "--dev-bind", "/", "/", "--size", "4096", "--tmpfs", str(tmp_path),
                           sys.executable, "-c", code, str(tmp_path), str(tmp_path / "filler")],
                          env=env, capture_output=True, text=True)
    assert f"cannot write to the run folder {tmp_path} (No space left on device; 0 bytes free" in full.stderr, \
        full.stderr


def test_optional_packages_are_checked_at_start(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else object())
    rundir.check_optional_packages([])
    rundir.check_optional_packages(["--tensorboard"])
    with pytest.raises(ModuleNotFoundError, match="--wandb needs the wandb package.*: pip install wandb"):
        rundir.check_optional_packages(["--tensorboard", "--wandb"])


# --- the embedded tiny model --------------------------------------------------------------------

def fake_build(calls):
    def build(folder, **settings):
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(settings, f)
        calls.append(settings)
    return build


def test_tiny_model_is_rebuilt_when_its_settings_change(tmp_path):
    path, calls = str(tmp_path / "tiny_model"), []
    small, big = {"hidden_size": 64, "seed": 0}, {"hidden_size": 128, "seed": 0}
    assert rundir.ensure_tiny_model(path, small, False, fake_build(calls)) == path
    rundir.ensure_tiny_model(path, small, False, fake_build(calls))
    rundir.ensure_tiny_model(path, small, True, fake_build(calls))
    assert calls == [small]  # built once
    rundir.ensure_tiny_model(path, big, False, fake_build(calls))
    assert calls == [small, big] and rundir.tiny_model_settings(path) == big
    with pytest.raises(ValueError, match=f"--resume: the tiny model in {path} was built with hidden_size 128 "
                                         r"\(now 64\).*--tiny-hidden"):
        rundir.ensure_tiny_model(path, small, True, fake_build(calls))
    assert calls == [small, big] and rundir.tiny_model_settings(path) == big  # untouched
    assert sorted(os.listdir(tmp_path)) == ["tiny_model"]


def test_a_tiny_model_killed_mid_write_is_rebuilt(tmp_path):
    path, calls = str(tmp_path / "tiny_model"), []
    settings = {"hidden_size": 64, "seed": 0}

    def killed(folder, **settings):
        os.makedirs(folder)
        open(os.path.join(folder, "config.json"), "w").close()
        raise KeyboardInterrupt  # the kill, after part of the folder was written
    with pytest.raises(KeyboardInterrupt):
        rundir.ensure_tiny_model(path, settings, False, killed)
    assert not os.path.exists(path)  # a later start never finds a half-written model in place
    rundir.ensure_tiny_model(path, settings, False, fake_build(calls))
    assert calls == [settings] and sorted(os.listdir(tmp_path)) == ["tiny_model"]
    os.remove(os.path.join(path, rundir.TINY_SETTINGS))  # a folder without its settings: rebuilt, even on resume
    rundir.ensure_tiny_model(path, settings, True, fake_build(calls))
    assert calls == [settings, settings]


def test_the_embedded_model_records_what_it_was_built_with(tmp_path):
    import train
    from config import make
    cfg = make(tiny_hidden=64, seed=5)
    path = rundir.ensure_tiny_model(str(tmp_path / "tiny_model"), train.tiny_model_args(cfg), False,
                                    lambda folder, **settings: build_tiny_model(folder, tiny_corpus(), **settings))
    assert load_policy(path).config.hidden_size == 64
    assert rundir.tiny_model_settings(path) == {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                                                "intermediate_size": 256, "max_positions": 8192, "seed": 5}


# --- task files ---------------------------------------------------------------------------------

def test_task_files_name_the_file_and_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"{empty} holds no task rows"):
        load_tasks(str(empty))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match=f"{tmp_path / 'empty.json'} holds no task rows"):
        load_tasks(str(tmp_path / "empty.json"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance_id": "a"}\n\n{"instance_id": "b",\n')  # line 3 is cut, after a blank line
    with pytest.raises(ValueError, match=f"{bad}, line 3, column 21: not valid JSON"):
        load_tasks(str(bad))


# --- metrics.jsonl ------------------------------------------------------------------------------

def test_non_finite_metrics_are_written_as_null_and_read_as_nan(tmp_path):
    log = Logger(str(tmp_path), rank=0, start=0)
    log.log(0, {"rollout/reward": 0.5, "rollout/success_given_compaction": 0.25, "value/explained_variance": 1.0})
    log.log(1, {"rollout/reward": math.inf, "rollout/success_given_compaction": 0.5,
                "value/explained_variance": math.nan, "train/skipped_steps": 1, "x": -math.inf})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 1, "rollout/reward": None, "rollout/success_given_compaction": 0.5,
                                    "value/explained_variance": None, "train/skipped_steps": 1, "x": None}
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    recs = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert math.isnan(recs[1]["value/explained_variance"]) and math.isnan(recs[1]["rollout/reward"])
    assert recs[0]["rollout/reward"] == 0.5
    plot_curve(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curve.png"))
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert json_line({"step": 2, "a": float("nan")}) == '{"step": 2, "a": null}\n'


def test_a_line_cut_by_a_kill_does_not_block_a_restart_but_a_bad_line_elsewhere_is_an_error(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json_line({"step": 0, "a": 1.0}) + json_line({"step": 1, "a": 2.0}) + '{"step": 2, "a"')
    with caplog.at_level(logging.WARNING):
        Logger(str(tmp_path), rank=0, start=2).log(2, {"a": 3.0})
    assert f"{path}: dropping line 3, cut off mid-write" in caplog.text
    assert [(r["step"], r["a"]) for r in read_metrics(str(path))] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    path.write_text(json_line({"step": 0}) + "{oops\n" + json_line({"step": 2}))
    with pytest.raises(ValueError, match=f"{path}, line 2, column 2: not a JSON record"):
        Logger(str(tmp_path), rank=0, start=2)
    with pytest.raises(ValueError, match=f"{path}, line 2"):
        read_metrics(str(path))
    path.write_text(json_line({"step": 0}) + '{"step": 1}')  # complete, only its newline missing: kept
    Logger(str(tmp_path), rank=0, start=3)
    assert [r["step"] for r in read_metrics(str(path))] == [0, 1]


# --- collectives: checkpoints and start-up checks on 2 ranks --------------------------------------

def test_checkpoints_are_verified_and_start_up_checks_stop_every_rank(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "tests/run_dir_check.py", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    root = tmp_path / "checkpoints"
    for s in seen:
        assert s["empty_root"] is None
        assert s["manifest_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "extra_rank0.pt",
                                       "extra_rank1.pt"]  # every rank's files, hashed by both
        assert s["clean"] == str(root / "step_00000001")
        # 4 KB flipped in the newest: every rank falls back to the previous one and loads its weights
        assert s["after_flip"] == str(root / "step_00000000") and s["loaded_step"] == 0
        assert s["loaded_step0_weights"]
        assert s["none_valid"].startswith(f"RuntimeError: no valid checkpoint in {root}")
        assert f"{s['flipped']}: its sha256 differs" in s["none_valid"]
        assert f"{s['truncated']}: 10 bytes where the manifest says" in s["none_valid"]
        assert s["no_manifest"].startswith(f"{root / 'step_00000000'} has no manifest.json")
        # bad input: the same error on every rank (or rank 0's, named), and no model loaded
        assert s["empty_tasks"] == f"ValueError: {tmp_path / 'empty.jsonl'} holds no task rows"
        assert s["prompt_too_long"].startswith("ValueError: the first prompt of task local__")   # after the tokenizer
        assert "needs --context-budget" in s["prompt_too_long"] and "but --context-budget is 1024" in s["prompt_too_long"]
        assert "--tensorboard needs the tensorboard package" in s["tensorboard"]
        assert f"FileExistsError: {tmp_path / 'held'} already holds a run" in s["held"]
        assert s["resume_nothing"].startswith(f"FileNotFoundError: --resume: no checkpoint in "
                                              f"{tmp_path / 'resume_nothing' / 'checkpoints'}")
        assert f"cannot write to the run folder {tmp_path / 'a_file' / 'run'}" in s["unwritable"]
    assert seen[1]["held"].startswith("RuntimeError: rank 0 failed: FileExistsError")
    assert p.stderr.count(f"WARNING: checkpoint {root / 'step_00000001'} is invalid") == 2  # rank 0, twice


# --- train.py end to end ------------------------------------------------------------------------

def largest_file(folder):
    return max((os.path.join(folder, n) for n in os.listdir(folder)), key=os.path.getsize)


def test_train_py_resumes_from_the_previous_checkpoint_when_the_latest_is_damaged(tmp_path):
    out = str(tmp_path / "run")
    args = ["--steps", "2", "--out-dir", out, "--save-every", "1"] + SMALL
    train_py(args + ["--overwrite"])  # nothing to replace yet
    first = load_policy(os.path.join(out, "hf")).state_dict()
    ckpts = os.path.join(out, "checkpoints")
    bad = largest_file(os.path.join(ckpts, "step_00000001"))
    size = os.path.getsize(bad)
    with open(bad, "r+b") as f:  # 4 KB flipped in the middle of the largest file of the latest
        f.seek(size // 2)
        block = f.read(4096)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    p = train_py(args + ["--resume"])
    assert f"WARNING: checkpoint {ckpts}/step_00000001 is invalid" in p.stderr and bad in p.stderr
    assert f"resumed from {ckpts}/step_00000000 at step 1" in p.stdout
    again = load_policy(os.path.join(out, "hf")).state_dict()
    for k, v in first.items():  # step 1 redone from step 0's checkpoint: the same weights, bit for bit
        torch.testing.assert_close(again[k], v, atol=0, rtol=0, msg=k)
    assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [0, 1]
    for step in sorted(os.listdir(ckpts)):  # a file of every checkpoint truncated: a clear error
        path = largest_file(os.path.join(ckpts, step))
        os.truncate(path, os.path.getsize(path) // 2)
    p = train_py(args + ["--resume"], ok=False)
    assert f"no valid checkpoint in {ckpts}" in p.stderr and "(truncated?)" in p.stderr
    assert "world 1 ·" not in p.stdout  # stopped before the models were built


@needs_bwrap
def test_a_full_disk_while_saving_names_the_checkpoint_and_the_free_space(tmp_path):
    """train.py with its out dir on a 1 MB tmpfs (bubblewrap, private to the process): the metrics
    fit, the first checkpoint does not."""
    model = build_tiny_model(str(tmp_path / "model"), tiny_corpus(), max_positions=8192)  # room for the default window
    out = tmp_path / "run"
    out.mkdir()
    p = train_py(["--model", model, "--steps", "1", "--out-dir", str(out), "--warmup-steps", "0"] + SMALL
                 + ["--value-pretrain-steps", "0"],
                 ok=False, prefix=[BWRAP, "--dev-bind", "/", "/", "--size", "1000000", "--tmpfs", str(out)])
    assert f"writing the checkpoint {out}/checkpoints/step_00000000.tmp failed with " in p.stderr, p.stderr[-3000:]
    assert "bytes free on its disk (is it full?)" in p.stderr
    assert os.listdir(out) == []  # the tmpfs is gone with the process
