"""ablations.py: the smallest grid (2 variants, 1 seed, 2 updates of 4 rollouts) end to end through
real train.py processes; the outputs exist and parse. The science is in the script's output.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_ablations.py
"""
import json
import os
import sys

import pytest
import torch

import ablations
import report
from model import ChatCodec, load_tokenizer
from engine import make_engine


def test_updates_to_uses_a_trailing_mean():
    assert ablations.updates_to([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.9) == 5
    assert ablations.updates_to([0.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.5) == 4
    assert ablations.updates_to([0.4] * 10, 0.5) is None


def test_bootstrap_ci_matches_a_slow_resampling_loop():
    import numpy as np
    diffs = [0.1, -0.05, 0.2, 0.0, 0.15, 0.05]
    mean, low, high = ablations.bootstrap_ci(diffs, resamples=2000, seed=3)
    rng = np.random.default_rng(3)  # the same draws, one resample at a time
    picks = rng.integers(0, len(diffs), (2000, len(diffs)))
    means = sorted(sum(diffs[i] for i in row) / len(diffs) for row in picks)
    assert mean == pytest.approx(sum(diffs) / len(diffs))
    assert low == pytest.approx(np.quantile(means, 0.025)) and high == pytest.approx(np.quantile(means, 0.975))
    assert low < mean < high
    assert ablations.bootstrap_ci([0.3] * 5) == pytest.approx((0.3, 0.3, 0.3))  # no spread, no interval


def test_paired_table_pairs_seeds_and_reads_the_interval():
    up, flat = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0], [0.5] * 6
    res = {"curves": {"base": [up] * 4, "summaries=frozen": [flat] * 3, "estimator=N": [up] * 4},
           "seeds": {"base": [0, 1, 2, 3], "summaries=frozen": [1, 2, 3], "estimator=N": [0, 1, 2, 3]},
           "correction": {"base": [0.9] * 4, "summaries=frozen": [0.9] * 3, "estimator=N": [0.9] * 4}}
    rows = [r for r in ablations.paired_table(res).splitlines() if r.startswith("| summ") or r.startswith("| esti")]
    assert len(rows) == 4  # two contrasts (long and normalizer not run), two measures each
    trained_vs_frozen = rows[0].split(" | ")
    assert trained_vs_frozen[2] == "3" and trained_vs_frozen[3] == "+0.250" and trained_vs_frozen[5] == "excludes 0"
    assert "within ±0.000" in rows[2] and "0.90 / 0.90" in rows[2]  # P and N identical here


def test_an_interrupted_run_resumes_from_a_checkpoint_or_starts_over(tmp_path):
    """train.py refuses an out dir that holds a run unless told: a run killed after a checkpoint
    is resumed, one killed before it (metrics.jsonl, no checkpoint) is overwritten."""
    echo = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]
    for name, has_checkpoint in (("early", False), ("late", True)):
        out = tmp_path / name
        (out / "checkpoints" / ("step_00000009" if has_checkpoint else "step_00000009.tmp")).mkdir(parents=True)
        (out / "metrics.jsonl").write_text('{"step": 0}\n')
        ablations.run(str(out), echo)
        assert (out / "log.txt").read_text().splitlines()[-1] == str(["--resume" if has_checkpoint else "--overwrite"])


def test_merge_joins_grids_of_disjoint_seeds_and_refuses_a_seed_twice():
    def grid(seeds, k_success):
        return {"curves": {"base": [[0.1 * s] for s in seeds]}, "seeds": {"base": list(seeds)},
                "test_time_k": {"short/K=1": k_success}, "variants": {"base": []}}
    a, b = grid([0, 1], [0.9, 0.8]), grid([2], [0.7])
    m = ablations.merge(a, b, "b.json")
    assert m["seeds"] == {"base": [0, 1, 2]} and m["curves"]["base"] == [[0.0], [0.1], [0.2]]
    assert m["test_time_k"] == {"short/K=1": [0.9, 0.8, 0.7]}  # follows base's seeds
    assert a["seeds"] == {"base": [0, 1]}  # inputs untouched
    with pytest.raises(ValueError, match=r"base seeds \[1\]"):
        ablations.merge(a, grid([1], [0.5]), "again.json")
    with pytest.raises(ValueError, match="no seed ids"):
        ablations.merge(a, {k: v for k, v in b.items() if k != "seeds"}, "old.json")
    with pytest.raises(ValueError, match="test-time K"):
        ablations.merge(a, {**b, "test_time_k": {}}, "no_eval.json")


def test_select_keeps_the_named_variants_and_base_s_test_time_k_only_with_base():
    res = {"curves": {"base": [[0.9]], "long/estimator=P": [[0.2]]}, "seeds": {"base": [0], "long/estimator=P": [0]},
           "test_time_k": {"short/K=1": [0.9]}, "variants": {"base": [], "long/estimator=P": ["--lam", "0.95"]}}
    assert ablations.select(res, ["base"]) == {"curves": {"base": [[0.9]]}, "seeds": {"base": [0]},
                                               "test_time_k": {"short/K=1": [0.9]}, "variants": {"base": []}}
    only_long = ablations.select(res, ["long/estimator=P", "estimator=N"])
    assert list(only_long["curves"]) == ["long/estimator=P"] and only_long["test_time_k"] == {}
    assert "seeds" not in ablations.select({k: v for k, v in res.items() if k != "seeds"}, ["base"])  # merge names it


def test_smallest_grid_writes_curves_table_and_figure(tmp_path):
    cfg = ablations.Config(out_dir=str(tmp_path), variants=("base", "summaries=frozen"), seeds=1, steps=2,
                           rollouts_per_step=4, warmup_steps=2, eval_rollouts=4,
                           extra="--value-pretrain-steps 1 --memory-noise 4 --context-budget 96")
    ablations.main(cfg)
    data = json.load(open(tmp_path / "curves.json"))
    assert set(data["curves"]) == {"base", "summaries=frozen"}
    assert data["seeds"] == {"base": [0], "summaries=frozen": [0]}
    assert all(len(c) == 2 and all(0 <= x <= 1 for x in c) for cs in data["curves"].values() for c in cs)
    assert set(data["test_time_k"]) == {f"{t}/K={k}" for t in ablations.EVAL_TASKS for k in ablations.EVAL_K}
    assert all(0 <= f <= 1 for fs in data["correction"].values() for f in fs) and data["correction"]["base"]  # eq. 14, per run
    table = (tmp_path / "table.md").read_text()
    assert "| base |" in table and "| summaries=frozen |" in table and "test-time K" in table
    assert (tmp_path / "ablations.png").stat().st_size > 0
    page = report.read_page(tmp_path / "report.html")  # the variants side by side, with each one's episodes
    assert {r["group"] for r in page["runs"]} == {"base", "summaries=frozen"} and "| base |" in page["table"]
    assert all([d["label"] for d in r["dumps"]] == ["step 0", "step 1"] and r["curves"]["rollout/reward"]
               for r in page["runs"])
    assert {"title": "summaries", "groups": ["base", "summaries=frozen"]} in page["panels"]
    assert os.path.exists(tmp_path / "base" / "s0" / "done")
    # a second call finds every run done and only rewrites the outputs
    mtime = os.path.getmtime(tmp_path / "base" / "s0" / "metrics.jsonl")
    ablations.main(cfg)
    assert os.path.getmtime(tmp_path / "base" / "s0" / "metrics.jsonl") == mtime
    # the test-time K evaluation samples the same episodes on every call
    model = str(tmp_path / "base" / "s0" / "hf")
    tok = load_tokenizer(model)
    engine, codec = make_engine("hf", model, tok.pad_token_id, torch.device("cpu")), ChatCodec(tok)
    tokens = [[s.response_ids for e in ablations.eval_episodes(engine, codec, 0, 4, 1, 2) for s in e.segments]
              for _ in range(2)]
    assert tokens[0] == tokens[1] and any(tokens[0])
    # ... under the flags the policy was trained with: a budget the task never fills, no compaction
    windows = [len(e.segments) for extra in ([], ["--context-budget", "1000"])
               for e in ablations.eval_episodes(engine, codec, 0, 12, 4, 2, extra)]
    assert windows[:2] != [1, 1] and windows[2:] == [1, 1]
    # --report-only trains nothing and leaves out what has not run
    cfg.variants, cfg.report_only = ("base", "summaries=masked"), True
    ablations.main(cfg)
    assert not os.path.exists(tmp_path / "summaries=masked")
    assert set(json.load(open(tmp_path / "curves.json"))["curves"]) == {"base"}
    assert "| base | 1 |" in (tmp_path / "table.md").read_text()


def test_every_variant_starts_from_its_seed_s_warm_up(tmp_path):
    cfg = ablations.Config(out_dir=str(tmp_path), variants=("long/estimator=N",), seeds=1, first_seed=3, steps=1,
                           rollouts_per_step=4, warmup_steps=1, eval_rollouts=1,
                           extra="--value-pretrain-steps 0")
    ablations.main(cfg)
    assert set(json.load(open(tmp_path / "curves.json"))["curves"]) == {"long/estimator=N"}
    log = (tmp_path / "long_estimator=N" / "s3" / "log.txt").read_text()
    assert f"--model {tmp_path / 'warmup_s3' / 'hf'} " in log and " --seed 3 " in log
    assert " ".join(ablations.LONG) in log and "--estimator N" in log
