"""Agent rollouts with context compaction — docs/method.md, 'Rollouts with compaction' and
'Windows are the samples'.

Every episode is its own sequential program (`_episode`): check the compaction trigger (eq. 7);
when it fires, append the summary instruction, let the same policy write the summary (eq. 8) and
rebuild the window (eq. 9); generate the action, step the environment, append the observation;
at its end, grade it. `run_episodes` runs many such programs at once on one asyncio loop: when an
episode's observation is ready its next request goes to the engine at once (scheduler.py batches
whatever is pending), while environment steps, sandbox start-ups and grading run in a bounded
thread pool. So no episode waits for the slowest turn of the others, and the engine is not idle
while commands run.

Every window becomes a `Segment`, the training sample: its prompt, and a response made of spans
(action, observation, summary_instruction, summary) with a loss mask that is 1 exactly on the
tokens the policy sampled. Contexts are built incrementally as token ids (model.ChatCodec) and
never re-tokenized from text, so trainer ids equal sampler ids token for token. An episode's
segments depend only on its own engine outputs and environment, never on the order in which
episodes' requests and commands complete.

Token layout of one window (G = generation prompt, E = turn close, O = observation message):
    prompt = s ⊕ u  (or s ⊕ u_resume(S) ⊕ tail steps)
    step i = G  A_i  E  O_i           (A_i sampled; G, E, O_i injected; atomic: never split)
The environment sees the answer of each turn, after any reasoning block (env.split_reasoning).
    end    = q_sum-message G  S       (summary instruction, then the sampled summary S)
"""
import asyncio
import concurrent.futures as cf
import logging
from dataclasses import dataclass, field

import torch

from compaction import can_compact, resume_text, select_tail, should_compact
from config import max_model_len
from env import split_reasoning
from scheduler import Progress, Scheduler

TRAINABLE_KINDS = ("action", "summary")
log = logging.getLogger(__name__)


@dataclass
class Segment:
    """One context window of a rollout: a training sample (docs/method.md, 'Windows are the samples')."""
    prompt_ids: list
    response_ids: list = field(default_factory=list)
    loss_mask: list = field(default_factory=list)  # 1 on sampled tokens
    logprobs: list = field(default_factory=list)  # sampler log-probs, 0 where mask is 0
    spans: list = field(default_factory=list)  # (kind, start, end) over response_ids
    rollout_id: int = 0
    segment_index: int = 0
    reward: float = 0.0

    @property
    def n_tokens(self):
        return sum(self.loss_mask)

    def append(self, ids, kind, logprobs=None, trainable=None):
        """Add a span; `trainable` defaults to whether the policy samples this kind of span."""
        trainable = kind in TRAINABLE_KINDS if trainable is None else trainable
        if trainable and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError(f"a sampled span ({kind}) needs one log-prob per token")
        if self.spans and self.spans[-1][0] == kind and not trainable:
            k, s, _ = self.spans[-1]  # merge adjacent injected spans of one kind
            self.spans[-1] = (k, s, len(self.response_ids) + len(ids))
        else:
            self.spans.append((kind, len(self.response_ids), len(self.response_ids) + len(ids)))
        self.response_ids += ids
        self.loss_mask += [int(trainable)] * len(ids)
        self.logprobs += list(logprobs) if trainable else [0.0] * len(ids)

    @property
    def ids(self):
        return self.prompt_ids + self.response_ids


@dataclass
class Episode:
    rollout_id: int
    task_id: str
    group_id: int
    segments: list = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    compactions: int = 0
    end_reason: str = ""  # submitted | max_turns | format_errors | budget_exhausted | context_overflow | timeout | env_error
    summaries: list = field(default_factory=list)


@dataclass
class _Live:
    """Loop state of one running episode."""
    ep: Episode
    env: object
    system: str = ""
    task: str = ""
    seg: Segment | None = None  # None until the environment has started
    steps: list = field(default_factory=list)  # atomic steps of this window: (action ids, E+O ids)
    format_errors: int = 0
    generations: int = 0  # engine requests so far: with the rollout id, the seed of the next one
    closed: bool = False  # env.close() was called

    @property
    def used(self):
        return len(self.seg.prompt_ids) + len(self.seg.response_ids)


def run_episodes(engine, codec, envs, cfg, rollout_ids, task_ids, group_ids=None, summary_engine=None,
                 lockstep=False, progress=False):
    """Run one episode per environment, all concurrently. Returns [Episode], by rollout id.

    All of them finish before it returns (a training step's batch is on-policy). At most as many
    run at once as the engines' KV caches hold windows (Engine.capacity), so the prefix cache keeps
    every live episode's window. summary_engine: another engine writes the summaries (the "frozen
    summarizer" ablation); its tokens are then not the policy's samples and are not trained (mask 0).
    lockstep: the baseline of bench_async.py, no more: every engine call waits until all live
    episodes have a request in, like a loop that advances them one turn at a time.
    progress: a bar on a terminal, else a line every 30 s (scheduler.Progress)."""
    group_ids = group_ids if group_ids is not None else rollout_ids
    if cfg.reserve <= len(codec.gen_prompt):  # else a window below the trigger could lack room for an action
        raise ValueError(f"reserve ({cfg.reserve}) must exceed the generation prompt's {len(codec.gen_prompt)} "
                         f"tokens: eq. 7 keeps it free for the next response")
    states = [_Live(Episode(*a), env) for a, env in zip(zip(rollout_ids, task_ids, group_ids), envs)]
    window = max_model_len(cfg, glue=len(codec.message({"role": "user", "content": cfg.summary_instruction}))
                           + len(codec.gen_prompt))
    engines = list(dict.fromkeys(e for e in (engine, summary_engine) if e is not None))
    capacities = [c for e in engines if hasattr(e, "capacity") and (c := e.capacity(window)) is not None]
    if any(c < 1 for c in capacities):
        raise ValueError(f"the engine's KV cache cannot hold one window of {window} tokens")
    live = min([max(1, len(envs))] + capacities)
    base_seed = int(torch.randint(0, 2**62, ()))
    pool = cf.ThreadPoolExecutor(max_workers=max(1, cfg.env_workers))
    try:
        asyncio.run(_run_all(engines, summary_engine is None, codec, states, cfg, pool, live, base_seed,
                             lockstep, progress))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a command that hangs must not hang the caller
        left = [s for s in states if not s.closed]  # interrupted (Ctrl-C) or failed: close the rest
        if left:
            with cf.ThreadPoolExecutor(max_workers=max(1, cfg.env_workers)) as closer:
                list(closer.map(_close, left))
    return sorted([s.ep for s in states], key=lambda e: e.rollout_id)


async def _run_all(engines, train_summaries, codec, states, cfg, pool, live, base_seed, lockstep, progress):
    """The episodes as tasks, and the scheduler serving their requests until all have ended.
    engines: the policy's, then the summaries' if it is another."""
    loop = asyncio.get_running_loop()
    engine, summarizer = engines[0], engines[-1]
    sched = Scheduler(engines, cfg.temperature, codec.stop_ids, lockstep)
    bar = Progress(len(states), sched, progress)
    slots = asyncio.Semaphore(live)

    def run(fn, *args):  # environment work goes to the pool, never blocks the loop
        return loop.run_in_executor(pool, fn, *args)

    async def one(s):
        async with slots:
            async with sched.admitted():
                await _episode(s, sched, engine, summarizer, train_summaries, codec, cfg, run, base_seed)
            _finish(s, await run(_grade, s))  # grading starts as soon as the episode ends
        bar.episode_done(s.ep)

    helpers = [asyncio.create_task(sched.serve()), asyncio.create_task(bar.report())]
    tasks = [asyncio.create_task(one(s)) for s in states]
    try:
        left = set(tasks)
        while left:
            done, _ = await asyncio.wait(left | {helpers[0]}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises an episode's error, or the server's (it ends only by failing)
            left -= done
    finally:
        for t in tasks + helpers:
            t.cancel()
        await asyncio.gather(*tasks, *helpers, return_exceptions=True)
        bar.close()


async def _episode(s, sched, engine, summarizer, train_summaries, codec, cfg, run, base_seed):
    """One episode, start to end, as a sequential program; `episode_seconds` is enforced while it
    waits on the engine or its environment."""
    messages = await run(_reset, s.env)
    if isinstance(messages, Exception):
        log.error("environment of rollout %s (task %s) failed to start", s.ep.rollout_id, s.ep.task_id,
                  exc_info=messages)
        s.ep.end_reason = "env_error"  # no window
        return
    s.system, s.task = messages[0]["content"], messages[1]["content"]
    s.seg = Segment(prompt_ids=codec.prompt(messages), rollout_id=s.ep.rollout_id)

    async def turns():
        while not (reason := _limit(s, cfg, len(codec.gen_prompt))):
            if s.steps and should_compact(s.used, cfg.context_budget, cfg.reserve) \
                    and can_compact(s.ep.compactions, cfg.max_compactions):
                await _compact(s, sched, summarizer, codec, cfg, base_seed, train_summaries)
            else:
                await _act(s, sched, engine, codec, cfg, run, base_seed)
            if s.ep.end_reason:
                return
        _end(s, reason)

    try:
        await asyncio.wait_for(turns(), cfg.episode_seconds or None)
    except TimeoutError:
        _end(s, "timeout")  # the window as it stood at its last complete span


def _reset(env):
    """env.reset(), or the exception it raised (a sandbox that would not start)."""
    try:
        return env.reset()
    except Exception as e:
        return e


def _end(s, reason):
    s.ep.end_reason = reason
    s.ep.segments.append(s.seg)


def _limit(s, cfg, gen_prompt_tokens):
    """Why the episode must end before its next turn, or "" to go on."""
    if s.ep.turns >= cfg.max_turns:
        return "max_turns"
    if s.format_errors >= cfg.max_format_errors:
        return "format_errors"
    if not can_compact(s.ep.compactions, cfg.max_compactions):
        # K spent: no summary is left to write, so the reserve T_comp that keeps room for one
        # is the window's too; it runs on until its whole budget C is used (each action capped
        # by the room left), until not one action token fits after the generation prompt.
        # Reward 0, still trained.
        return "budget_exhausted" if s.used + gen_prompt_tokens >= cfg.context_budget else ""
    if should_compact(s.used, cfg.context_budget, cfg.reserve) and not s.steps:
        return "context_overflow"  # nothing to summarize: the prompt alone is too long
    return ""


async def _generate(s, sched, engine, prompt, max_new_tokens, base_seed):
    """The engine's reply to `prompt`, seeded by (batch seed, rollout id, request number)."""
    seed = hash((base_seed, s.ep.rollout_id, s.generations)) & (2**62 - 1)  # ints hash alike in every process
    s.generations += 1
    return await sched.generate(engine, prompt, max_new_tokens, seed)


async def _compact(s, sched, engine, codec, cfg, base_seed, trainable=True):
    """Summary (eq. 8) then resume (eq. 9). The window changes only once the summary is back, so
    an episode stopped while it waits (episode_seconds) keeps a whole window."""
    instr = codec.message({"role": "user", "content": cfg.summary_instruction}) + codec.gen_prompt
    g = await _generate(s, sched, engine, s.seg.ids + instr, cfg.max_summary_tokens, base_seed)
    s.seg.append(instr, "summary_instruction")
    s.seg.append(g.token_ids, "summary", g.logprobs, trainable=trainable)
    summary = split_reasoning(codec.decode(g.token_ids))[1].strip()
    s.ep.summaries.append(summary)
    s.ep.compactions += 1
    head = codec.prompt([{"role": "system", "content": s.system},
                         {"role": "user", "content": resume_text(s.task, summary, cfg.repeat_task,
                                                                 cfg.resume_template)}])
    step_ids = [codec.gen_prompt + a + eo for a, eo in s.steps]
    k = select_tail(len(head), [len(x) for x in step_ids], cfg.context_budget, cfg.reserve, cfg.keep_last)
    s.ep.segments.append(s.seg)
    if k is None:  # even s ⊕ u_resume(S) leaves less than the reserve: cannot continue
        s.ep.end_reason = "context_overflow"
        return
    tail = step_ids[len(step_ids) - k:] if k else []
    s.steps = s.steps[len(s.steps) - k:] if k else []
    s.seg = Segment(prompt_ids=head + [t for x in tail for t in x], rollout_id=s.ep.rollout_id,
                    segment_index=len(s.ep.segments))


async def _act(s, sched, engine, codec, cfg, run, base_seed):
    """One action, then the environment's step (in the pool) and its observation."""
    room = min(cfg.max_action_tokens, cfg.context_budget - s.used - len(codec.gen_prompt))  # >= 1 (_limit)
    g = await _generate(s, sched, engine, s.seg.ids + codec.gen_prompt, room, base_seed)
    if s.seg.response_ids:
        s.seg.append(codec.gen_prompt, "observation")
    else:
        s.seg.prompt_ids = s.seg.prompt_ids + codec.gen_prompt  # a window opens with s ⊕ u ⊕ G
    s.seg.append(g.token_ids, "action", g.logprobs)
    s.ep.turns += 1
    step = await run(_env_step, s, split_reasoning(codec.decode(g.token_ids))[1])  # the env acts on the answer
    if step is None:  # the environment itself failed: end this episode, keep the others
        _end(s, "env_error")
        return
    s.format_errors = s.format_errors + 1 if step.format_error else 0
    if step.done:
        _end(s, "submitted")
        return
    obs = clip_tokens(codec, step.observation, cfg.max_observation_tokens)
    eo = codec.after_turn(g.token_ids, {"role": "user", "content": obs})
    s.seg.append(eo, "observation")
    s.steps.append((g.token_ids, eo))


def clip_tokens(codec, text, max_tokens):
    """Keep the first and last max_tokens/2 tokens of a long observation, with a marker between.

    Why: the observation that closes a window may push it past C (the trigger is checked after
    the step); capping it bounds the longest prompt the engine ever sees to
    C + max_observation_tokens + |q_sum| + max_summary_tokens (see config.max_model_len)."""
    ids = codec.encode_text(text)
    if len(ids) <= max_tokens:
        return text
    marker = f"\n[... {len(ids) - max_tokens} tokens elided ...]\n"
    half = max(0, (max_tokens - len(codec.encode_text(marker))) // 2)
    return codec.decode(ids[:half]) + marker + codec.decode(ids[len(ids) - half:])


def _env_step(s, text):
    """env.step, or None when the environment raised (a sandbox or Docker failure, not the
    agent's doing): one broken sandbox must not take down a batch of thousands. Logged loudly."""
    try:
        return s.env.step(text)
    except Exception:
        log.exception("environment of rollout %s (task %s) failed; ending the episode",
                      s.ep.rollout_id, s.ep.task_id)
        return None


def _grade(s):
    """The outcome reward: graded only when the agent submitted (docs/method.md, 'How a rollout
    ends': a rollout that ran out of budget, turns, format or time gets 0 and is still trained).
    The environment is closed either way; a grading failure is logged and scores 0, with end_reason
    "env_error"."""
    try:
        return float(s.env.reward()) if s.ep.end_reason == "submitted" else 0.0
    except Exception:
        log.exception("grading rollout %s (task %s) failed", s.ep.rollout_id, s.ep.task_id)
        s.ep.end_reason = "env_error"
        return 0.0
    finally:
        _close(s)


def _close(s):
    """env.close(); a failure to close is logged and changes nothing (the episode and its reward
    are complete)."""
    s.closed = True
    try:
        s.env.close()
    except Exception:
        log.exception("closing the environment of rollout %s (task %s) failed", s.ep.rollout_id, s.ep.task_id)


def _finish(s, reward):
    s.ep.reward = reward
    for seg in s.ep.segments:
        seg.reward = reward


def format_episode(ep, decode):
    """Plain-text dump of an episode for people: every window, every span, what is trained."""
    lines = [f"=== rollout {ep.rollout_id}  task {ep.task_id}  reward {ep.reward}  turns {ep.turns}  "
             f"compactions {ep.compactions}  ended: {ep.end_reason}"]
    for seg in ep.segments:
        lines.append(f"--- segment {seg.segment_index}: prompt {len(seg.prompt_ids)} tokens, "
                     f"response {len(seg.response_ids)} tokens, trainable {seg.n_tokens}")
        lines.append(f"[prompt] {decode(seg.prompt_ids)!r}")
        for kind, a, b in seg.spans:
            mark = "TRAIN" if kind in TRAINABLE_KINDS else "     "
            lines.append(f"[{mark} {kind}] {decode(seg.response_ids[a:b])!r}")
    return "\n".join(lines)
