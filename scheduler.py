"""Serving the generation requests of concurrently running episodes (rollout.run_episodes).

Each episode asks `Scheduler.generate` for one completion at a time and waits for it; `serve`
runs on the same asyncio loop and gives the engines whatever is pending:
* an engine with `step` (vllm_engine.VLLMEngine) batches continuously: a request is submitted as
  soon as it comes, joins the running batch at the engine's next step, and returns the moment it
  finishes;
* an engine with only `generate` (engine.HFEngine, scripted engines) gets the pending requests
  as one call. The call starts once every live episode has a request in, or once the oldest
  request has waited GATHER times the last call's duration: when commands are quick the whole
  batch gathers (as few calls as a lockstep loop makes); when some are slow, the others do not
  wait for them, and the wait costs the engine at most that fraction of its time.
Engine calls run on the loop's thread and block it while they compute; the environment threads go
on meanwhile, and their results are picked up when the call returns.
"""
import asyncio
import contextlib
import itertools
import sys
import time
from dataclasses import dataclass


@dataclass(eq=False)
class _Request:
    prompt: list
    max_new_tokens: int
    seed: int
    future: asyncio.Future
    since: float  # time.monotonic() when it came in
    key: str = ""  # its id in a continuously batching engine, once submitted


class Scheduler:
    """The queue between episodes and engines (see the module docstring). lockstep: hold every
    request until all live episodes have one in and no engine is busy — the baseline loop."""

    GATHER = 0.1

    def __init__(self, engines, temperature, stop_token_ids, lockstep=False):
        self.engines = list(engines)
        self.temperature, self.stop, self.lockstep = temperature, list(stop_token_ids), lockstep
        self.pending = {e: [] for e in self.engines}  # not yet given to the engine
        self.running = {e: {} for e in self.engines}  # key -> request, inside a continuous engine
        self.live = 0  # admitted episodes that have not ended
        self.waiting = 0  # of them, those waiting on a request
        self.sampled_tokens = 0
        self.last_call = 0.0  # seconds of the last batch `generate`
        self.wake = asyncio.Event()
        self.keys = (str(i) for i in itertools.count())

    @contextlib.asynccontextmanager
    async def admitted(self):
        """Counts an episode as live while the block runs (lockstep and gathering wait for it)."""
        self.live += 1
        try:
            yield
        finally:
            self.live -= 1
            self.wake.set()

    async def generate(self, engine, prompt, max_new_tokens, seed):
        """The engine's Generation for `prompt`; a cancelled caller withdraws its request."""
        req = _Request(list(prompt), max_new_tokens, seed, asyncio.get_running_loop().create_future(),
                       time.monotonic())
        self.pending[engine].append(req)
        self.waiting += 1
        self.wake.set()
        try:
            return await req.future
        finally:
            self.waiting -= 1
            if req.future.cancelled():
                if self.running[engine].pop(req.key, None):
                    engine.abort([req.key])
                elif req in self.pending[engine]:
                    self.pending[engine].remove(req)

    async def serve(self):
        """Runs until cancelled; raises what an engine raised."""
        while True:
            self.wake.clear()
            served = [self._serve_continuous(e) if hasattr(e, "step") else self._serve_batch(e)
                      for e in self.engines]
            if any(served):
                await asyncio.sleep(0)  # let the episodes whose replies came take their next step
                continue
            deadlines = [reqs[0].since + self.GATHER * self.last_call
                         for e, reqs in self.pending.items() if reqs and not hasattr(e, "step")]
            timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines and not self.lockstep else None
            with contextlib.suppress(TimeoutError):  # a gathering deadline passed: serve again
                await asyncio.wait_for(self.wake.wait(), timeout)

    def _everyone_waits(self):
        return self.waiting == self.live and not any(self.running.values())

    def _serve_batch(self, engine):
        reqs = self.pending[engine]
        if not reqs or not (self._everyone_waits() or not self.lockstep
                            and time.monotonic() - reqs[0].since >= self.GATHER * self.last_call):
            return False
        self.pending[engine] = []
        start = time.monotonic()
        gens = engine.generate([r.prompt for r in reqs], [r.max_new_tokens for r in reqs], self.temperature,
                               self.stop, seeds=[r.seed for r in reqs])
        self.last_call = time.monotonic() - start
        for r, g in zip(reqs, gens):
            self._reply(r, g)
        return True

    def _serve_continuous(self, engine):
        if self.pending[engine] and (not self.lockstep or self._everyone_waits()):
            for r in self.pending[engine]:
                r.key = next(self.keys)
                engine.submit(r.key, r.prompt, r.max_new_tokens, self.temperature, self.stop, r.seed)
                self.running[engine][r.key] = r
            self.pending[engine] = []
        if not self.running[engine]:
            return False
        for key, g in engine.step():
            self._reply(self.running[engine].pop(key), g)
        return True

    def _reply(self, req, gen):
        self.sampled_tokens += len(gen.token_ids)
        req.future.set_result(gen)


class Progress:
    """Episodes finished, tokens sampled and compactions while a rollout runs: a bar on a terminal,
    else (a log file) a plain line every `every` seconds. Off when not `enabled` (other ranks)."""

    def __init__(self, total, sched, enabled, every=30.0):
        self.total, self.sched, self.every = total, sched, every
        self.enabled = enabled
        self.done = self.compactions = 0
        self.start = time.monotonic()
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc="rollout", unit="episode", leave=False, position=1)
            self.every = 1.0

    def episode_done(self, ep):
        self.done += 1
        self.compactions += ep.compactions
        if self.bar:
            self.bar.update(1)

    async def report(self):
        """Runs until cancelled, refreshing the bar or writing the line."""
        while self.enabled:
            await asyncio.sleep(self.every)
            self._show()

    def _show(self):
        stats = f"{self.sched.sampled_tokens} tokens, {self.compactions} compactions"
        if self.bar:
            self.bar.set_postfix_str(stats)
        else:
            print(f"rollout: {self.done}/{self.total} episodes done, {stats}, "
                  f"{time.monotonic() - self.start:.0f} s", flush=True)

    def close(self):
        if self.bar:
            self.bar.close()
