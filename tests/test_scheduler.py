"""The concurrent agent loop (rollout.run_episodes on scheduler.Scheduler): the same episodes
whatever order requests and commands complete in, a hanging environment stops only its own
episode, no more episodes live than the engine's KV cache holds, and an interrupted rollout
closes every environment it started.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_scheduler.py
"""
import os
import random
import signal
import threading
import time

import pytest
import torch

import memory_task
from engine import HFEngine
from rollout import run_episodes
from test_rollout import ScriptedEngine, config, memory_reply, row, tiny  # noqa: F401 (fixture)


class DelayedEnv(memory_task.MemoryEnv):
    """A memory task whose commands take a random time: completion orders differ run to run.
    Counts the environments open at once in `opened` (shared by a batch)."""

    def __init__(self, r, rng, opened):
        super().__init__(r)
        self.rng, self.opened, self.closed = rng, opened, 0

    def reset(self):
        with self.opened["lock"]:
            self.opened["now"] += 1
            self.opened["most"] = max(self.opened["most"], self.opened["now"])
        return super().reset()

    def step(self, action):
        time.sleep(self.rng.uniform(0, 0.01))
        return super().step(action)

    def close(self):
        self.closed += 1
        with self.opened["lock"]:
            self.opened["now"] -= 1


def batch(n, seed):
    rng = random.Random(seed)
    opened = {"lock": threading.Lock(), "now": 0, "most": 0}
    rows = [row(k, n) for k, n in zip("ABCDABCD", (6, 1, 8, 3, 0, 7, 2, 5))][:n]
    return [DelayedEnv(r, random.Random(rng.random()), opened) for r in rows], opened


def record(eps, logprobs=True):
    return [(e.rollout_id, e.reward, e.turns, e.compactions, e.end_reason, e.summaries,
             [(s.prompt_ids, s.response_ids, s.loss_mask, s.logprobs if logprobs else None, s.spans,
               s.segment_index) for s in e.segments]) for e in eps]


def run(engine, codec, envs, cfg, **kw):
    return run_episodes(engine, codec, envs, cfg, list(range(len(envs))), [f"t{i}" for i in range(len(envs))], **kw)


def test_the_same_episodes_whatever_the_completion_order(tiny):
    """Token for token: the lockstep baseline, then shuffled completion orders (random command
    times, batches gathered differently), with a scripted engine and with the real model."""
    tok, codec, lm = tiny
    cfg = config()
    want = record(run(ScriptedEngine(tok, memory_reply), codec, batch(8, 0)[0], cfg, lockstep=True))
    assert {e[4] for e in want} == {"submitted"} and sum(e[3] for e in want) >= 4
    for seed in (1, 2):
        assert record(run(ScriptedEngine(tok, memory_reply), codec, batch(8, seed)[0], cfg)) == want
    # the real model samples each request from its own seed, so its batch does not matter (only
    # the log-probs move, by float rounding: padding changes the shapes of the sums)
    cfg = config(temperature=0.8, max_turns=12)
    got = []
    for seed, lockstep in ((0, True), (1, False), (2, False)):
        torch.manual_seed(5)
        got.append(run(HFEngine(lm, tok.pad_token_id), codec, batch(4, seed)[0], cfg, lockstep=lockstep))
    for eps in got[1:]:
        assert record(eps, logprobs=False) == record(got[0], logprobs=False)
        for a, b in zip([s for e in eps for s in e.segments], [s for e in got[0] for s in e.segments]):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_hanging_environment_times_out_alone(tiny):
    tok, codec, _ = tiny
    release = threading.Event()

    class Hanging(memory_task.MemoryEnv):
        closed = 0

        def step(self, action):
            if self.turn == 1:
                release.wait(30)  # a command that never returns (until the test ends)
            return super().step(action)

        def close(self):
            Hanging.closed += 1

    envs = [Hanging(row("A"))] + [memory_task.MemoryEnv(row(k)) for k in "BCD"]
    start = time.monotonic()
    try:
        eps = run(ScriptedEngine(tok, memory_reply), codec, envs, config(episode_seconds=1.0))
    finally:
        release.set()
    assert time.monotonic() - start < 10
    assert eps[0].end_reason == "timeout" and eps[0].reward == 0.0 and Hanging.closed == 1
    assert eps[0].segments[0].spans[-1][0] == "action"  # the window as it stood: the action sent
    assert [e.end_reason for e in eps[1:]] == ["submitted"] * 3 and all(e.reward == 1.0 for e in eps[1:])


def test_no_more_live_episodes_than_the_kv_cache_holds(tiny):
    tok, codec, _ = tiny

    class SmallCache(ScriptedEngine):
        def capacity(self, window_tokens):
            self.window = window_tokens
            return 2

    engine = SmallCache(tok, memory_reply)
    envs, opened = batch(6, 3)
    cfg = config()
    eps = run(engine, codec, envs, cfg)
    assert opened["most"] == 2 and opened["now"] == 0
    assert all(e.end_reason == "submitted" for e in eps)
    # the longest window: C, one capped observation, q_sum's message with G, a summary
    q_sum = codec.message({"role": "user", "content": cfg.summary_instruction}) + codec.gen_prompt
    assert engine.window == cfg.context_budget + cfg.max_observation_tokens + len(q_sum) + cfg.max_summary_tokens
    assert max(len(p) + len(g) for p, g in engine.calls) <= engine.window


@pytest.mark.parametrize("how", ["engine", "signal"])
def test_an_interrupted_rollout_closes_every_environment(tiny, how):
    """Ctrl-C (SIGINT) mid-rollout, or a KeyboardInterrupt out of the engine: run_episodes raises
    it, and no environment is left open."""
    tok, codec, _ = tiny
    calls = []

    def reply(text):
        calls.append(1)
        if how == "engine" and len(calls) == 20:
            raise KeyboardInterrupt
        return memory_reply(text)

    class Slow(DelayedEnv):
        def step(self, action):
            time.sleep(0.05)
            return super().step(action)

    envs, opened = batch(8, 4)
    envs = [Slow(e.row, e.rng, opened) for e in envs]
    if how == "signal":
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        run(ScriptedEngine(tok, reply), codec, envs, config(env_workers=2))
    assert opened["most"] == 8 and opened["now"] == 0 and all(e.closed == 1 for e in envs)
