"""Metrics and logging for train.py — every key written to metrics.jsonl is documented in
docs/metrics.md. Episode statistics are summed on each rank, all-reduced, then turned into
means, so they describe the global batch whatever the number of ranks.
"""
import json
import logging
import math
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

import fsdp

logger = logging.getLogger(__name__)

ENDINGS = ("submitted", "max_turns", "format_errors", "budget_exhausted", "context_overflow", "timeout",
           "env_error")


def rollout_metrics(episodes, rows):
    """Sums over this rank's episodes; all-reduced, then turned into means (docs/metrics.md)."""
    compacted = [e for e in episodes if e.compactions > 0]
    summary_tokens = sum(sum(b - a for k, a, b in s.spans if k == "summary")
                         for e in episodes for s in e.segments)
    sums = {"episodes": len(episodes), "reward": sum(e.reward for e in episodes),
            "compactions": sum(e.compactions for e in episodes), "turns": sum(e.turns for e in episodes),
            "segments": sum(len(e.segments) for e in episodes), "summary_tokens": summary_tokens,
            "summaries": sum(e.compactions for e in episodes),
            "compacted": len(compacted), "compacted_reward": sum(e.reward for e in compacted),
            "trainable_tokens": sum(float(r["mask"].sum()) for r in rows),
            "sampled_tokens": sum(s.n_tokens for e in episodes for s in e.segments)}
    for end in ENDINGS:
        sums[f"end_{end}"] = sum(e.end_reason == end for e in episodes)
    keys = sorted(sums)
    t = fsdp.all_reduce(torch.tensor([float(sums[k]) for k in keys]))
    g = dict(zip(keys, t.tolist()))
    n = max(g["episodes"], 1)
    out = {"rollout/reward": g["reward"] / n, "rollout/compactions": g["compactions"] / n,
           "rollout/turns": g["turns"] / n, "rollout/segments": g["segments"] / n,
           "rollout/summary_tokens": g["summary_tokens"] / max(g["summaries"], 1),
           "rollout/success_given_compaction": g["compacted_reward"] / max(g["compacted"], 1),
           "rollout/truncation_rate": (g["end_budget_exhausted"] + g["end_context_overflow"]) / n,
           "rollout/trainable_tokens": g["trainable_tokens"], "rollout/sampled_tokens": g["sampled_tokens"]}
    out.update({f"end/{e}": g[f"end_{e}"] / n for e in ENDINGS})
    return out


def segment_share_metrics(rows, max_k=4):
    """Share of |Â| mass (what drives the gradient) and mean Â per segment index k."""
    sums = torch.zeros(2 * (max_k + 1), dtype=torch.float64)
    for r in rows:
        k = min(r["segment_index"], max_k)
        sums[k] += float((r["advantages"].abs() * r["mask"]).sum())
        sums[max_k + 1 + k] += float(r["mask"].sum())
    g = fsdp.all_reduce(sums)
    total = max(float(g[:max_k + 1].sum()), 1e-12)
    out = {}
    for k in range(max_k + 1):
        if g[max_k + 1 + k] > 0:
            out[f"adv/share_seg{k}"] = float(g[k]) / total
            out[f"adv/abs_mean_seg{k}"] = float(g[k]) / float(g[max_k + 1 + k])
    return out


def explained_variance(rows):
    """1 − Var(G − V) / Var(G) over trainable tokens, global."""
    s = torch.zeros(5, dtype=torch.float64)
    for r in rows:
        m = r["mask"].double()
        g, v = r["returns"].double(), r["old_values"].double()
        s += torch.stack([m.sum(), (g * m).sum(), (g * g * m).sum(), ((g - v) * m).sum(), ((g - v) ** 2 * m).sum()])
    n, g1, g2, d1, d2 = fsdp.all_reduce(s).tolist()
    n = max(n, 1.0)
    var_g = g2 / n - (g1 / n) ** 2
    var_d = d2 / n - (d1 / n) ** 2
    return {"value/explained_variance": 1.0 - var_d / var_g if var_g > 1e-12 else float("nan")}


class Logger:
    """Rank 0 writes metrics.jsonl (and TensorBoard / W&B when asked); other ranks hold a
    do-nothing twin so the loop never branches on rank."""

    def __init__(self, out_dir, rank, start, tensorboard=False, wandb_config=None):
        """wandb_config: the run's config, to log to Weights & Biases; None = no W&B."""
        self.on = rank == 0
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.tb = self.wb = None
        if not self.on:
            return
        os.makedirs(out_dir, exist_ok=True)
        # keep the steps before `start`: a resumed run redoes the rest
        kept = [r for r in read_records(self.path) if r["step"] < start] if os.path.exists(self.path) else []
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:  # rewritten beside, then renamed: a kill now loses nothing
            f.writelines(json_line(r) for r in kept)
        os.replace(tmp, self.path)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
        if wandb_config is not None:
            import wandb
            self.wb = wandb.init(project="compactionrl", config=wandb_config)

    def log(self, step, metrics):
        if not self.on:
            return
        with open(self.path, "a") as f:
            f.write(json_line({"step": step, **metrics}))
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wb:
            self.wb.log(metrics, step=step)

    def text(self, name, content):
        if self.on:
            with open(os.path.join(os.path.dirname(self.path), name), "w") as f:
                f.write(content)


def json_line(record):
    """One metrics.jsonl line. Strict JSON has no NaN or infinity: a non-finite number is null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def read_records(metrics_path):
    """The records of a metrics.jsonl as written (null for a non-finite value). A last line cut off
    mid-write (no newline, not JSON: the run was killed while logging) is dropped with a warning;
    any other malformed line raises ValueError naming the file and line."""
    with open(metrics_path) as f:
        lines = f.readlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line.rstrip("\n")))
        except json.JSONDecodeError as e:
            if number == len(lines) and not line.endswith("\n"):
                logger.warning(f"{metrics_path}: dropping line {number}, cut off mid-write: {line[:80]!r}")
                break
            raise ValueError(f"{metrics_path}, line {number}, column {e.colno}: not a JSON record "
                             f"({e.msg}): {line[:80]!r}") from e
    return records


def read_metrics(metrics_path):
    """The records of a metrics.jsonl, one per step in order; null (a non-finite value) reads as
    NaN, so sums and plots need no special case."""
    return [{k: math.nan if v is None else v for k, v in r.items()} for r in read_records(metrics_path)]


def plot_curve(metrics_path, png_path):
    """Success (reward) per step and the compaction rate, from metrics.jsonl."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    recs = [r for r in read_metrics(metrics_path) if "rollout/reward" in r]
    if not recs:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in recs], [r["rollout/reward"] for r in recs], label="success (reward)")
    ax.plot([r["step"] for r in recs], [r["rollout/success_given_compaction"] for r in recs],
            label="success | ≥1 compaction", alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


@contextmanager
def timed(times, name):
    t = time.time()
    yield
    times[f"time/{name}"] = time.time() - t


def merge_sums(acc, sums):
    """Fold metric sums into `acc` in place: keys ending in _max/_min keep the extremum, the
    rest add up."""
    for k, v in sums.items():
        v = float(v)
        acc[k] = max(acc.get(k, -math.inf), v) if k.endswith("_max") else \
            min(acc.get(k, math.inf), v) if k.endswith("_min") else acc.get(k, 0.0) + v
    return acc


def reduce_sums(per_minibatch):
    """Add metric sums over mini-batches, then over ranks (max/min for the extrema). A rank whose
    batch held no token (every episode failed) has no keys: the ranks first agree on the union,
    so every rank makes the same all-reduces, and its missing values count as nothing."""
    acc = {}
    for sums in per_minibatch:
        merge_sums(acc, sums)
    keys = sorted(acc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, keys)
        keys = sorted(set().union(*every))
    out = {}
    for k in keys:  # same order on every rank
        op, empty = (dist.ReduceOp.MAX, -math.inf) if k.endswith("_max") else \
            (dist.ReduceOp.MIN, math.inf) if k.endswith("_min") else (dist.ReduceOp.SUM, 0.0)
        out[k] = float(fsdp.all_reduce(acc.get(k, empty), op))
    return out


def step_line(step, steps, m):
    """One plain line per step for a log file, where no progress bar is drawn."""
    return (f"step {step + 1}/{steps} · reward {m['rollout/reward']:.3f} · success|compaction "
            f"{m['rollout/success_given_compaction']:.3f} · compactions {m['rollout/compactions']:.2f} · "
            f"{m['time/step']:.1f} s/step · {m['time/tokens_per_s']:.0f} tokens/s")
