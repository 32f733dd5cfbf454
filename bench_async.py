"""Asynchronous against lockstep rollouts when environment commands are slow and heavy-tailed.

    OMP_NUM_THREADS=1 python bench_async.py                  # vLLM when installed, else HF
    OMP_NUM_THREADS=1 python bench_async.py --engines hf --episodes 64 --turns 6 \
        --mean-action 32 --max-action-tokens 96 --context-budget 3072   # HF's batch generate is slower

Scripted environments (`LatencyEnv`) stand in for sandboxes: each command takes a log-normal
time (median `latency_median`, 99th percentile `latency_p99`), drawn from the episode's own seed so
both loops meet the same delays, and returns a few lines; an episode submits after `turns` turns.
The actions come from the real tiny model; a random `1 / mean_action` share of the vocabulary
counts as a stop token, so action lengths vary (geometrically, up to `max_action_tokens`).

Per engine, on the same engine object: run_episodes(lockstep=True) (the baseline: every engine
call waits for all live episodes) and run_episodes (each episode on its own), at the latency mix
and with zero latency. Reported: wall time, the speed-up (lockstep wall ÷ async wall), the engine's
busy fraction (time inside its generate/step calls ÷ wall time), sampled tokens per second.

Sizing: the work offered must exceed what the engine can serve, or no loop can keep it busy.
The script prints both: offered = episodes × mean tokens per turn ÷ mean command time (the rate at
which episodes would ask if the engine answered at once), and served = the engine's tokens per
second in the zero-latency async run (its throughput with every episode ready); offered ÷ served
should stay above 1 (`--episodes`, `--mean-action`). The goals set the other sizes (docs/rollouts.md
works them out): lockstep idles for each turn's slowest command, the asynchronous loop only for
the last episodes' final commands, so the defaults run many turns (`--turns`) of short actions
(`--mean-action`, `--max-action-tokens`): enough generation in all to dwarf that final wait, little
per turn against a turn's slowest command.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: see vllm_engine's docstring

import importlib.util  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from config import RolloutConfig  # noqa: E402
from engine import HFEngine  # noqa: E402
from env import Step  # noqa: E402
from model import ChatCodec, build_tiny_model, load_policy, load_tokenizer  # noqa: E402
from rollout import run_episodes  # noqa: E402
from train import tiny_corpus  # noqa: E402


@dataclass
class Config:
    engines: str = ""
    """Comma-separated engines (hf, vllm); empty = vllm when installed, else hf."""
    episodes: int = 64
    """Episodes per run: enough that the work offered exceeds what the engine serves (see above)."""
    turns: int = 36
    """Commands per episode before it submits: lockstep pays each turn's slowest command, so the
    speed-up grows with the turns (see the sizing above)."""
    latency_median: float = 0.5
    """Median command time, seconds."""
    latency_p99: float = 10.0
    """99th percentile of the command time, seconds (the log-normal's tail)."""
    command_timeout: float = 60.0
    """Commands are cut at this many seconds, as SWEEnv's are (train.py's --command-timeout)."""
    mean_action: int = 40
    """Mean action length, tokens (stop ids cover 1 / mean_action of the vocabulary): a turn's
    generation short against a turn's slowest command (see the sizing above)."""
    max_action_tokens: int = 120
    """Cap on one action, tokens."""
    context_budget: int = 6144
    """C: room for every turn at its cap, so the benchmark measures scheduling, not compaction."""
    hidden_size: int = 256
    """Width of the benchmark's random model: big enough that generation, not Python, is the
    engine's cost (the 64-wide default model answers too fast to keep busy)."""
    layers: int = 4
    """Its depth."""
    seed: int = 0
    """Seed of the latencies, the stop ids and sampling."""
    kv_cache_mib: int = 4096
    """vLLM KV-cache budget: room for every episode's longest window (run_episodes admits no more)."""


class LatencyEnv:
    """A scripted environment whose commands take a log-normal time (see the module docstring)."""

    def __init__(self, seed, turns, median, sigma, timeout):
        self.rng, self.turns, self.median, self.sigma, self.timeout = random.Random(seed), turns, median, sigma, timeout
        self.turn = 0

    def reset(self):
        return [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Fix the failing test in the repository."}]

    def step(self, action):
        if self.median:
            time.sleep(min(self.timeout, self.median * math.exp(self.sigma * self.rng.gauss(0, 1))))
        self.turn += 1
        return Step(f"ran: turn {self.turn}\ntests: {self.turn} failed\ndone", self.turn >= self.turns)

    def reward(self):
        return 1.0

    def close(self):
        pass


class TimedEngine:
    """Forwards to an engine and sums the seconds spent inside its generate and step calls."""

    def __init__(self, engine):
        self.engine, self.busy = engine, 0.0
        if hasattr(engine, "step"):  # continuous batching: the scheduler submits and steps
            self.submit, self.abort, self.step = engine.submit, engine.abort, self._timed(engine.step)
        self.generate = self._timed(engine.generate)
        self.capacity = engine.capacity

    def _timed(self, fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - start
        return call


def rollout(engine, codec, cfg, latency, lockstep):
    """One batch: (wall seconds, busy fraction, sampled tokens, mean tokens per action)."""
    sigma = math.log(cfg.latency_p99 / cfg.latency_median) / 2.326 if latency else 0.0  # z(0.99) = 2.326
    envs = [LatencyEnv(f"{cfg.seed}:{i}", cfg.turns, cfg.latency_median if latency else 0.0, sigma, cfg.command_timeout)
            for i in range(cfg.episodes)]
    rcfg = RolloutConfig(context_budget=cfg.context_budget, reserve=16, max_compactions=0, max_turns=cfg.turns,
                         max_action_tokens=cfg.max_action_tokens, max_summary_tokens=64, max_observation_tokens=64,
                         env_workers=cfg.episodes)  # commands run side by side, as in separate sandboxes
    timed = TimedEngine(engine)
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    eps = run_episodes(timed, codec, envs, rcfg, list(range(cfg.episodes)), ["t"] * cfg.episodes, lockstep=lockstep)
    wall = time.perf_counter() - start
    tokens = sum(s.n_tokens for e in eps for s in e.segments)
    if ends := {e.end_reason for e in eps} - {"submitted"}:
        print(f"  (some episodes ended otherwise than by submitting: {ends}; raise --context-budget)")
    return wall, timed.busy / wall, tokens, tokens / sum(e.turns for e in eps)


def make(name, model_path, tok, cfg):
    if name == "hf":
        return HFEngine(load_policy(model_path), tok.pad_token_id)
    from vllm_engine import VLLMEngine
    return VLLMEngine(model_path, max_model_len=cfg.context_budget + 512, seed=cfg.seed,
                      kv_cache_bytes=cfg.kv_cache_mib << 20)


def bench(cfg, model_path):
    tok = load_tokenizer(model_path)
    codec = ChatCodec(tok)
    rng = random.Random(cfg.seed)
    specials = set(tok.all_special_ids)
    ordinary = [i for i in range(len(tok)) if i not in specials]
    codec.stop_ids = codec.stop_ids + rng.sample(ordinary, len(ordinary) // cfg.mean_action)
    names = cfg.engines.split(",") if cfg.engines else ["vllm" if importlib.util.find_spec("vllm") else "hf"]
    mean_latency = cfg.latency_median * math.exp((math.log(cfg.latency_p99 / cfg.latency_median) / 2.326) ** 2 / 2)
    print(f"{cfg.episodes} episodes × {cfg.turns} turns · command time log-normal, median {cfg.latency_median} s, "
          f"p99 {cfg.latency_p99} s (mean {mean_latency:.2f} s) · actions ~{cfg.mean_action} tokens "
          f"(cap {cfg.max_action_tokens}) · torch threads {torch.get_num_threads()} · load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs")
    print("| engine | latency | lockstep s | async s | speed-up | busy lockstep | busy async | tokens/s async |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        engine = make(name, model_path, tok, cfg)
        rollout(engine, codec, Config(**{**vars(cfg), "episodes": 8, "turns": 2}), False, False)  # warm-up
        served = None
        for latency in (False, True):
            lock = rollout(engine, codec, cfg, latency, True)
            conc = rollout(engine, codec, cfg, latency, False)
            if not latency:
                served = conc[2] / conc[0]
            label = f"p50 {cfg.latency_median} s, p99 {cfg.latency_p99} s" if latency else "zero"
            print(f"| {name} | {label} | {lock[0]:.1f} | {conc[0]:.1f} | {lock[0] / conc[0]:.2f}× | "
                  f"{100 * lock[1]:.0f}% | {100 * conc[1]:.0f}% | {conc[2] / conc[0]:.0f} |", flush=True)
        offered = cfg.episodes * conc[3] / mean_latency
        print(f"  {name}: offered {offered:.0f} tokens/s (episodes × {conc[3]:.1f} tokens per action ÷ mean "
              f"command time) vs served {served:.0f} tokens/s (zero-latency async): {offered / served:.1f}×")


def main(cfg):
    with tempfile.TemporaryDirectory(prefix="bench_tiny_") as tmp:
        bench(cfg, build_tiny_model(tmp, tiny_corpus(), hidden_size=cfg.hidden_size, num_layers=cfg.layers,
                                    intermediate_size=4 * cfg.hidden_size, num_heads=cfg.hidden_size // 64,
                                    head_dim=64, max_positions=cfg.context_budget + 512, seed=cfg.seed))


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
