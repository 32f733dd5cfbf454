"""The paper's ablations at CPU scale, on the built-in memory task, with train.py itself.

    python ablations.py --quick          # trained vs frozen summaries and test-time K, 2 seeds
    python ablations.py                  # the full grid: 5 panels, 5 seeds (about an hour on 2 cores)
    python ablations.py --jobs 4         # more runs at once on a bigger machine
    python ablations.py --report-only    # table and figure of the runs finished so far
    python ablations.py --seeds 2 --first-seed 2   # add seeds 2 and 3 to a grid (or split it over machines)
    python ablations.py --report-only --merge other/curves.json   # report two such grids as one
    python ablations.py --paired --seeds 20   # the paper's contrasts (PAIRS), 20 paired seeds, bootstrap CIs

Every run is `python train.py <flags>` in its own process (one thread), so each variant uses the
trainer's own functions, loss and estimators — there is no separate toy trainer. Per seed, one
supervised warm-up (train.py --steps 0) is shared by every variant: all variants of a seed start
RL from the same policy. Interrupted? Run the same command again: finished runs are kept, the
others resume from their latest checkpoint.

The questions (one figure panel each), against the paper's ablations on the 106B model
(full 66.8; w/o token-level loss 60.0; w/o cross-trajectory GAE 63.0; w/o summary training 64.5):
  summaries   trained vs masked out of the loss vs written by a frozen copy of the initial policy
  estimator   P (cross-trajectory GAE) vs N (naive per-segment) vs E (bootstrap across the
              boundary) vs G (group-relative), on the short task ((γλ)^N_after ≈ 0.89) and on
              a long one (≈ 0.5, see LONG)
  normalizer  token (paper eq. 12) vs segment vs rollout; a batch mixes rollouts with 0 and 1
              compactions (train.py's --memory-p-short)
  lambda      λ from the rollout's trainable length (paper) vs from the segment's
  test-time K the base policy (trained with K = max_compactions) evaluated with K = 0 … 4

Writes to out_dir: curves.json (every run's success per update), table.md, ablations.png, and
report.html (report.py): the variants' curves side by side, the table, and the episodes each
variant's first seed dumped (at its first and last update), window by window with their credit.
"""
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass

import report
from fsdp import checkpoints
from metrics import read_metrics

HERE = os.path.dirname(os.path.abspath(__file__))
# The long task: one compaction, like the short one, but a longer window after it (C = 90, 13
# distractors), so the first window's tokens have 7 trainable tokens after them (one per action,
# one answer) instead of 2. With a fixed λ = 0.9 the factor (γλ)^N_after of eq. 14 (train.py logs
# it as adv/correction) is then 0.9^7 ≈ 0.48, against 0.89 on the short task with the paper's
# adaptive λ, which cannot go below exp(−2/3) ≈ 0.51 by construction. (A task with two
# compactions instead was not learned from the warm-up in 25 updates: seed 0, 4-token actions.)
LONG = ["--memory-noise", "13", "--context-budget", "90", "--lam-mode", "fixed", "--lam", "0.9"]

# name -> (panels it appears in, train.py flags). "base" is the paper's recipe on the short task.
VARIANTS = {
    "base": (("summaries", "estimator/short", "normalizer", "lambda"), []),
    "summaries=masked": (("summaries",), ["--summaries", "masked"]),
    "summaries=frozen": (("summaries",), ["--summaries", "frozen"]),
    "estimator=N": (("estimator/short",), ["--estimator", "N"]),
    "estimator=E": (("estimator/short",), ["--estimator", "E"]),
    "estimator=G": (("estimator/short",), ["--estimator", "G", "--group-size", "4"]),
    "long/estimator=P": (("estimator/long",), LONG),
    "long/estimator=N": (("estimator/long",), LONG + ["--estimator", "N"]),
    "long/estimator=E": (("estimator/long",), LONG + ["--estimator", "E"]),
    "long/estimator=G": (("estimator/long",), LONG + ["--estimator", "G", "--group-size", "4"]),
    "normalizer=segment": (("normalizer",), ["--normalizer", "segment"]),
    "normalizer=rollout": (("normalizer",), ["--normalizer", "rollout"]),
    "lambda=segment": (("lambda",), ["--lam-mode", "segment"]),
}
QUICK = ("base", "summaries=frozen")  # does the summary have to be learned? and test-time K
# The paper's three contrasts, as (label, A, B). Per seed, A and B continue from the same warm-up
# and see the same tasks, so A − B is a paired difference; its mean over seeds gets a bootstrap CI.
PAIRS = (("summaries: trained − frozen", "base", "summaries=frozen"),
         ("estimator, short task: P − N", "base", "estimator=N"),
         ("estimator, long task: P − N", "long/estimator=P", "long/estimator=N"),
         ("normalizer: token − segment", "base", "normalizer=segment"))
EVAL_K = (0, 1, 2, 3, 4)
EVAL_TASKS = {"short": 6, "long": 12}  # distractors at train.py's C: the training task (1 compaction) and one needing 2


@dataclass
class Config:
    out_dir: str = "runs/ablations"
    """Where runs, curves.json, table.md and ablations.png go."""
    quick: bool = False
    """The quick subset: variants in QUICK, 2 seeds."""
    paired: bool = False
    """The variants of PAIRS only (give --seeds 20 or more): a table of paired differences with
    bootstrap confidence intervals, paired.md."""
    seeds: int = 5
    """Seeds per variant (the quick subset uses 2)."""
    first_seed: int = 0
    """Seeds are first_seed … first_seed + seeds − 1: to add seeds to a grid, or split it over machines."""
    variants: tuple[str, ...] = ()
    """Run (and report, also from --merge files) only these VARIANTS (names as in the table); empty =
    all, or QUICK with --quick."""
    steps: int = 20
    """RL updates per run (the lr decays to 0 over them; the first value_pretrain_steps train the critic only)."""
    rollouts_per_step: int = 64
    """Rollouts per update: fewer than train.py's 128, so that 20 paired seeds of PAIRS fit in a few
    hours of 2 cores; the paired design, not the batch, carries the comparison's precision."""
    warmup_steps: int = 150
    """Supervised warm-up steps, once per seed (train.py --warmup-steps)."""
    jobs: int = 2
    """Runs at once, one CPU thread each."""
    eval_rollouts: int = 256
    """Rollouts per K in the test-time compaction panel."""
    eval_seeds: int = 5
    """Test-time K is evaluated for base's first eval_seeds finished seeds (each costs 10 × eval_rollouts episodes)."""
    extra: str = ""
    """More train.py flags for every run, e.g. "--tiny-hidden 64" (space-separated)."""
    report_only: bool = False
    """Train nothing: tabulate and plot the runs that have finished so far (a partial grid)."""
    merge: tuple[str, ...] = ()
    """curves.json files of grids run elsewhere (other seeds, e.g. with --first-seed on another
    machine or session) to report together with this one; a (variant, seed) in two grids is an error."""


def train_cmd(out_dir, seed, flags, cfg):
    return ([sys.executable, os.path.join(HERE, "train.py"), "--out-dir", out_dir, "--seed", str(seed),
             "--rollouts-per-step", str(cfg.rollouts_per_step), "--save-every", "10", "--dump-every", "1000"]
            + cfg.extra.split() + flags)


def run_dir(root, name, seed):
    return os.path.join(root, name.replace("/", "_"), f"s{seed}")


def run(out_dir, cmd, after=None):
    """Run one train.py to completion (resuming when interrupted before), then after(out_dir) if
    given; a `done` file marks both finished."""
    done = os.path.join(out_dir, "done")
    if os.path.exists(done):
        return
    os.makedirs(out_dir, exist_ok=True)
    # a run killed after a checkpoint continues from it; one killed before starts over
    resume = bool(checkpoints(os.path.join(out_dir, "checkpoints")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = cmd + (["--resume"] if resume else ["--overwrite"])
    with open(os.path.join(out_dir, "log.txt"), "a") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); see {out_dir}/log.txt")
    if after is not None:
        after(out_dir)
    open(done, "w").close()


def curve(out_dir, key="rollout/success_given_compaction"):
    """Success per update from a run's metrics.jsonl."""
    return [m[key] for m in read_metrics(os.path.join(out_dir, "metrics.jsonl"))]


def updates_to(c, level, window=5):
    """First update at which the trailing `window`-update mean reaches `level` (None if never)."""
    for i in range(len(c)):
        w = c[max(0, i - window + 1):i + 1]
        if len(w) == window and sum(w) / window >= level:
            return i
    return None


def evaluate(model_path, seed, n, extra=()):
    """{"<task>/K=<k>": success} of the policy at `model_path` on n fresh memory tasks of each of
    EVAL_TASKS (no short ones), with at most k compactions for each k in EVAL_K; `extra` = the
    train.py flags the policy was trained with (Config.extra), so the tasks match its training."""
    import torch
    from model import ChatCodec, load_tokenizer
    from engine import make_engine
    torch.set_num_threads(1)
    tok = load_tokenizer(model_path)
    engine, codec = make_engine("hf", model_path, tok.pad_token_id, torch.device("cpu")), ChatCodec(tok)
    return {f"{task}/K={k}": sum(e.reward for e in eval_episodes(engine, codec, seed, n_noise, k, n, extra)) / n
            for task, n_noise in EVAL_TASKS.items() for k in EVAL_K}


def eval_episodes(engine, codec, seed, n_noise, k, n, extra=()):
    """n rollouts on fresh memory tasks with n_noise distractors and at most k compactions, under
    train.py's Config with the flags `extra`; the same episodes on every call (HFEngine samples
    from torch's global RNG, seeded here per (seed, task, k))."""
    import torch
    import train
    from config import override, parse_config
    from rollout import run_episodes
    cfg = override(parse_config(list(extra)), max_compactions=k, memory_p_short=0.0, memory_noise=n_noise, seed=seed)
    envs, ids = train.make_envs(cfg, step=10**6, rank=0, per_rank=n)  # steps training never reaches
    torch.manual_seed((seed * 1_000_003 + n_noise) * 1009 + k)
    return run_episodes(engine, codec, envs, train.rollout_config(cfg), list(range(n)), ids)


def mean_sd(xs):
    return (statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0) if xs else (float("nan"), 0.0)


def table(curves, evals):
    lines = ["| variant | seeds | final success (mean ± sd) | updates to 0.5 | updates to 0.9 |",
             "| --- | --- | --- | --- | --- |"]
    for name in curves:
        finals = [statistics.mean(c[-5:]) for c in curves[name]]
        cells = []
        for level in (0.5, 0.9):
            hit = [u for u in (updates_to(c, level) for c in curves[name]) if u is not None]
            cells.append(f"{statistics.median(hit):.0f} ({len(hit)}/{len(curves[name])} seeds)" if hit
                         else f"– (0/{len(curves[name])})")
        m, sd = mean_sd(finals)
        lines.append(f"| {name} | {len(curves[name])} | {m:.2f} ± {sd:.2f} | {cells[0]} | {cells[1]} |")
    if evals:
        lines += ["", "| test-time K | " + " | ".join(f"{t} task" for t in EVAL_TASKS) + " |",
                  "| --- |" + " --- |" * len(EVAL_TASKS)]
        for k in EVAL_K:
            cells = ["{:.2f} ± {:.2f}".format(*mean_sd(evals[f"{t}/K={k}"])) for t in EVAL_TASKS]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        n = len(evals[f"short/K={EVAL_K[0]}"])
        lines.append(f"\n(success of the base policy, trained with K = 3 on the short task; mean ± sd over {n} seeds)")
    return "\n".join(lines) + "\n\nsuccess = rollout/success_given_compaction (mean of the last 5 updates for the final).\n"


def figure(curves, evals, names, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    order = list(dict.fromkeys(p for v in VARIANTS.values() for p in v[0]))
    panels = [p for p in order if sum(p in VARIANTS[n][0] for n in names) > 1]  # a comparison, not one line
    cols = max(1, len(panels) + bool(evals))
    fig, axes = plt.subplots(1, cols, figsize=(4 * cols, 3.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for name in names:
            if panel in VARIANTS[name][0] and name in curves:
                n = min(len(c) for c in curves[name])
                a = np.array([c[:n] for c in curves[name]])
                mu, sd = a.mean(0), a.std(0)
                ax.plot(mu, label=name)
                ax.fill_between(range(n), mu - sd, mu + sd, alpha=0.2)
        ax.set(title=panel, xlabel="update", ylim=(0, 1))
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("success given compaction")
    if evals:
        ax = axes[0][-1]
        for t in EVAL_TASKS:
            xs = [evals[f"{t}/K={k}"] for k in EVAL_K]
            ax.errorbar(EVAL_K, [statistics.mean(x) for x in xs], yerr=[mean_sd(x)[1] for x in xs],
                        marker="o", capsize=3, label=f"{t} task")
        ax.legend(fontsize=7)
        ax.set(title="test-time K (base policy)", xlabel="max compactions at test time", ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def results(root, names, seeds, eval_rollouts, extra=(), eval_seeds=5):
    """What curves.json holds: {"curves": {variant: [success per update, per seed]}, "seeds":
    {variant: [seed]}, "correction": {variant: [mean eq.-14 factor over the run, per seed]},
    "test_time_k": {"<task>/K=<k>": [success per seed of base]}, "variants": {variant: train.py
    flags}}, over the runs of `names` × `seeds` that have finished."""
    finished = {n: [s for s in seeds if os.path.exists(os.path.join(run_dir(root, n, s), "done"))] for n in names}
    names = [n for n in names if finished[n]]
    evals = {}
    if "base" in names:  # per seed, then regrouped as {"<task>/K=<k>": [success per seed]}
        per_seed = [evaluate_run(run_dir(root, "base", s), s, eval_rollouts, extra)
                    for s in finished["base"] if s < seeds[0] + eval_seeds]  # the seeds main's rl() evaluated
        evals = {key: [e[key] for e in per_seed] for key in per_seed[0]} if per_seed else {}
    return {"curves": {n: [curve(run_dir(root, n, s)) for s in finished[n]] for n in names},
            "seeds": {n: finished[n] for n in names}, "test_time_k": evals,
            "correction": {n: [statistics.mean(curve(run_dir(root, n, s), "adv/correction")) for s in finished[n]]
                           for n in names},
            "variants": {n: VARIANTS[n][1] for n in names}}


def bootstrap_ci(diffs, level=0.95, resamples=10_000, seed=0):
    """(mean, low, high): the mean of paired differences and its percentile-bootstrap interval,
    resampling seeds with replacement."""
    import numpy as np
    d = np.asarray(diffs, dtype=float)
    means = d[np.random.default_rng(seed).integers(0, len(d), (resamples, len(d)))].mean(1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(d.mean()), float(low), float(high)


def paired_table(res):
    """Markdown: for each contrast of PAIRS with both variants run on 2+ common seeds, the mean
    paired difference A − B (success over the whole run, and final) with its 95 % bootstrap CI,
    and the eq.-14 factor each variant logged."""
    lines = ["| contrast | success | seeds | mean A − B | 95 % CI | reading | eq.-14 factor logged, A / B |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for label, a, b in PAIRS:
        if a not in res["curves"] or b not in res["curves"]:
            continue
        ca, cb = (dict(zip(res["seeds"][n], res["curves"][n])) for n in (a, b))
        common = sorted(set(ca) & set(cb))
        if len(common) < 2:
            continue
        factor = {n: dict(zip(res["seeds"][n], res.get("correction", {}).get(n, []))) for n in (a, b)}
        fa, fb = (statistics.mean([factor[n].get(s, float("nan")) for s in common]) for n in (a, b))
        for what, f in (("mean over the run", statistics.mean), ("final (last 5)", lambda c: statistics.mean(c[-5:]))):
            m, low, high = bootstrap_ci([f(ca[s]) - f(cb[s]) for s in common])
            reading = "excludes 0" if low > 0 or high < 0 else f"within ±{max(abs(low), abs(high)):.3f}"
            lines.append(f"| {label} | {what} | {len(common)} | {m:+.3f} | [{low:+.3f}, {high:+.3f}] | "
                         f"{reading} | {fa:.2f} / {fb:.2f} |")
    return "\n".join(lines) + "\n"


def evaluate_run(out_dir, seed, n, extra=()):
    """evaluate() of a trained base run, computed once in a process of its own (so runs of the
    pool evaluate in parallel) and kept in out_dir/eval.json."""
    path = os.path.join(out_dir, "eval.json")
    if not os.path.exists(path):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            res = pool.submit(evaluate, os.path.join(out_dir, "hf"), seed, n, extra).result()
        with open(path + ".tmp", "w") as f:
            json.dump(res, f)
        os.replace(path + ".tmp", path)
    return json.load(open(path))


def select(res, names):
    """Results `res` (as results() returns) restricted to the variants in `names`; test-time K rows
    belong to base and go with it."""
    keep = [n for n in res["curves"] if n in names]
    out = {k: {n: res[k][n] for n in keep if n in res[k]} for k in ("curves", "seeds", "variants", "correction")
           if k in res}
    return {**out, "test_time_k": res["test_time_k"] if "base" in keep else {}}


def merge(a, b, where):
    """Results `a` and `b` (as results() returns) of disjoint seeds, as one. Test-time K rows
    follow base's seeds, so base must come with its evaluation in both or in neither."""
    if "seeds" not in b:
        raise ValueError(f"{where} has no seed ids (written before ablations.py recorded them); add "
                         '"seeds": {variant: [seed, ...]} to it, in the order of its curves')
    out = {k: {n: list(v) for n, v in a[k].items()} for k in ("curves", "seeds", "test_time_k")}
    out["variants"] = {**b["variants"], **a["variants"]}
    out["correction"] = {n: list(v) for n, v in a.get("correction", {}).items()}
    for n, xs in b.get("correction", {}).items():
        out["correction"].setdefault(n, []).extend(xs)
    for n, curves in b["curves"].items():
        twice = set(out["seeds"].get(n, [])) & set(b["seeds"][n])
        if twice:
            raise ValueError(f"{where}: {n} seeds {sorted(twice)} are already in the grid being reported")
        out["curves"].setdefault(n, []).extend(curves)
        out["seeds"].setdefault(n, []).extend(b["seeds"][n])
    if bool(a["test_time_k"]) != bool(b["test_time_k"]) and "base" in a["curves"] and "base" in b["curves"]:
        raise ValueError(f"{where}: test-time K was evaluated for base in one grid and not the other")
    for key, xs in b["test_time_k"].items():
        out["test_time_k"].setdefault(key, []).extend(xs)
    return out


def main(cfg):
    pairs = list(dict.fromkeys(n for _, a, b in PAIRS for n in (a, b)))
    names = list(cfg.variants or (QUICK if cfg.quick else pairs if cfg.paired else VARIANTS))
    unknown = [n for n in names if n not in VARIANTS]
    assert not unknown, f"unknown variants {unknown}; known: {list(VARIANTS)}"
    seeds = range(cfg.first_seed, cfg.first_seed + (2 if cfg.quick else cfg.seeds))
    root = os.path.abspath(cfg.out_dir)
    warm = {s: os.path.join(root, f"warmup_s{s}") for s in seeds}

    def warm_up(s):
        run(warm[s], train_cmd(warm[s], s, ["--steps", "0", "--warmup-steps", str(cfg.warmup_steps)], cfg))

    def rl(job):  # every variant of a seed continues from that seed's warm-up
        name, s = job
        flags = ["--model", os.path.join(warm[s], "hf"), "--warmup-steps", "0", "--steps", str(cfg.steps)]
        flags += VARIANTS[name][1] + ([] if name == "base" else ["--no-export-hf"])  # base: for test-time K
        evaluated = name == "base" and s < cfg.first_seed + cfg.eval_seeds  # test-time K: the first seeds only
        after = (lambda d: evaluate_run(d, s, cfg.eval_rollouts, cfg.extra.split())) if evaluated else None
        run(run_dir(root, name, s), train_cmd(run_dir(root, name, s), s, flags, cfg), after)

    if not cfg.report_only:
        with ThreadPoolExecutor(cfg.jobs) as pool:  # threads only wait on processes
            list(pool.map(warm_up, seeds))
            # seed by seed, so a grid stopped early holds whole seeds (pairs); within a seed the long
            # runs (≈ 1.5× the tokens) first
            jobs = sorted(((n, s) for n in names for s in seeds), key=lambda j: (j[1], not j[0].startswith("long/")))
            list(pool.map(rl, jobs))
    res = results(root, names, seeds, cfg.eval_rollouts, cfg.extra.split(), cfg.eval_seeds)
    for path in cfg.merge:
        other = json.load(open(path))
        res = merge(res, select(other, names) if cfg.variants else other, path)
    names = [n for n in VARIANTS if n in res["curves"]]  # table and legend in VARIANTS order
    curves, evals = {n: res["curves"][n] for n in names}, res["test_time_k"]
    with open(os.path.join(root, "curves.json"), "w") as f:
        json.dump(res, f)
    md = table(curves, evals)
    with open(os.path.join(root, "table.md"), "w") as f:
        f.write(md)
    pairs_md = paired_table(res)
    with open(os.path.join(root, "paired.md"), "w") as f:
        f.write(pairs_md)
    figure(curves, evals, names, os.path.join(root, "ablations.png"))
    here = {n: [(s, run_dir(root, n, s)) for s in res["seeds"].get(n, []) if os.path.isdir(run_dir(root, n, s))]
            for n in names}  # runs of a --merge grid stay where they ran: their curves are in the table only
    order = dict.fromkeys(p for v in VARIANTS.values() for p in v[0])
    panels = {p: [n for n in names if p in VARIANTS[n][0]] for p in order}
    report.write_ablation_report(root, {n: runs for n, runs in here.items() if runs}, panels, md)
    print(md + "\n" + pairs_md)


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
