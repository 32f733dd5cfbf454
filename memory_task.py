"""The built-in long-horizon memory task: the CPU default, made so that compaction must fire and
only summaries that carry the key can earn reward.

An episode (every line after the task is one atomic step z = (action, observation)):

    system  "Remember the key."                                       user "Task: memory."
    action → "noise B" …        0 to max_key_at distractors before the key
    action → "key C"            the key, shown once
    action → "noise A" …        the other distractors (n_noise in all), same alphabet as the key
    action → "answer?"          the question
    answer                      reward 1 if the answer's first symbol is the key, else 0

Actions before the question are free (the environment ignores them; train.py caps them at one
token, so every step costs the same 7 tokens). The context budget C is sized (config.py) so the
episode does not fit in one window: compaction fires after a few noise steps, the resume keeps
the last k steps (the key is never among them), and the key survives only if the policy's own
summary carries it. With K = 0 there is no summary to make room for, so the single window runs on
past the trigger to its whole budget C: where the question still fits, reading the context is
enough (as for the K = 0 baseline of a real agent), and where it does not, the reward is 0.

`p_short` mixes in short episodes whose question comes before any compaction (0 to
max_noise_short distractors); `max_key_at` lets up to that many distractors come before the key.

How the tiny model gets there (train.py): a supervised warm-up on episodes written by
`WarmupDemoEngine` teaches the shape of each turn, to answer with the key that is in the context
(half of its episodes are short, and the key's position varies, so the key is read by content —
which is also how a summary is read back), and to write a summary that copies ONE observation
line of the window, picked at random. After the warm-up the policy summarizes "noise X" far more
often than "key X", and a compacted episode succeeds by chance (1/n_keys). That the key is what
to keep is never shown; every gain in `rollout/success_given_compaction` is a summary that
learned it by RL alone, credited through the GAE across the compaction boundary.
"""
import random
import re

from engine import Generation
from env import Step

SYSTEM = "Remember the key."
TASK = "Task: memory."
QUESTION = "answer?"
# The task's own, short summary instruction and resume message: the general ones
# (compaction.SUMMARY_INSTRUCTION and RESUME_WITH_TASK), written for real agents, are long against
# this task's few-token turns and would multiply the CPU cost of every window around a compaction.
SUMMARY_INSTRUCTION = "Context full. Summarize."
RESUME = "{task} Summary:\n{summary}"


def symbols(n):
    if not 2 <= n <= 26:
        raise ValueError(f"memory task: n_symbols must be in [2, 26], got {n}")
    return [chr(ord("A") + i) for i in range(n)]


def make_tasks(n, seed, n_keys=4, n_noise=6, p_short=0.0, max_noise_short=2, max_key_at=2, filler=0):
    """n task rows {"task_id", "key", "noise": [symbols], "key_at", "filler"}: the key (uniform over
    n_keys) is shown after key_at of the distractors; `filler` words of padding follow every
    observation line (windows then grow by observations, as an agent's do, not by sampled tokens)."""
    rng = random.Random(seed)
    alphabet = symbols(n_keys)
    rows = []
    for i in range(n):
        steps = rng.randint(0, max_noise_short) if rng.random() < p_short else n_noise
        rows.append({"task_id": f"memory-{seed}-{i}", "key": rng.choice(alphabet),
                     "noise": [rng.choice(alphabet) for _ in range(steps)],
                     "key_at": rng.randint(0, min(max_key_at, steps)), "filler": filler})
    return rows


class MemoryEnv:
    """reset() → messages; step(action) → Step; reward() after the episode."""

    def __init__(self, row):
        self.row = row
        self.turn = 0
        self.answer = None

    def reset(self):
        self.turn = 0
        self.answer = None
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]

    def observations(self):
        noise = [f"noise {s}" for s in self.row["noise"]]
        at = self.row.get("key_at", 0)
        lines = noise[:at] + [f"key {self.row['key']}"] + noise[at:]
        pad = "\n" + " ".join(["pad"] * self.row["filler"]) if self.row.get("filler") else ""
        return [line + pad for line in lines] + [QUESTION]

    def step(self, action):
        self.turn += 1
        obs = self.observations()
        if self.turn <= len(obs):
            return Step(observation=obs[self.turn - 1], done=False)
        self.answer = action
        return Step(observation="", done=True)

    def reward(self):
        """1 if the first non-space character of the answer is the key."""
        return float(self.answer is not None and self.answer.strip()[:1] == self.row["key"])

    def close(self):
        pass


def corpus(n_symbols=26):
    """Lines for the embedded tokenizer, so task fragments are few tokens."""
    alphabet = symbols(n_symbols)
    lines = [SYSTEM, TASK, QUESTION, SUMMARY_INSTRUCTION, RESUME] * 50
    # frequent enough that " A" … " Z" become single tokens: the key is then one token after "key"
    lines += [f"key {s}" for s in alphabet] * 40 + [f"noise {s}" for s in alphabet] * 40
    return lines


class WarmupDemoEngine:
    """Writes the turns of the supervised warm-up: actions "ok"; a summary: one observation line of
    the window ("noise X" or "key X", or the previous summary), chosen uniformly at random; an
    answer: the symbol after the last "key" in the context, else the summary's symbol.

    So the warm-up teaches the shape of every turn, to answer from context, and that a summary
    repeats a line — never which line matters. After a compaction the demo answer repeats the
    kept line's symbol, right only when the random pick was the key line (or a distractor that
    happens to equal the key). Why copy a line rather than write a random symbol: a random
    symbol would teach "after `key` in a summary comes an unrelated symbol", against the copy
    the answer skill uses, and RL would have to unlearn it; a copied line is faithful from the
    start, and RL only moves which line it copies (docs/results.md, "how the default recipe was
    found", has the runs behind this).
    """

    def __init__(self, codec, n_keys, seed):
        self.tok = codec.tok
        self.keys = symbols(n_keys)
        self.seed = seed
        # a prompt ending in one of these asks for the answer / for a summary (template-agnostic)
        self.asks_answer, self.asks_summary = (codec.message({"role": "user", "content": q}) + codec.gen_prompt
                                               for q in (QUESTION, SUMMARY_INSTRUCTION))

    def _reply(self, ids, rng):
        if ids[-len(self.asks_answer):] == self.asks_answer:
            context = self.tok.decode(ids)
            keys = re.findall(r"key ([A-Z])", context)
            if keys:
                return keys[-1]
            kept = re.findall(r"Summary:\n(?:noise|key) ([A-Z])", context)  # the summary's symbol
            return kept[-1] if kept else rng.choice(self.keys)
        if ids[-len(self.asks_summary):] == self.asks_summary:
            # observation lines (and the previous summary's line): a whole message or line
            lines = re.findall(r"(?:^|[>\n])((?:noise|key) [A-Z])(?=[<\n])", self.tok.decode(ids))
            return rng.choice(lines) if lines else f"noise {rng.choice(self.keys)}"
        return "ok"

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        out = []
        for i, (p, n) in enumerate(zip(prompts, max_new_tokens)):
            # each request's pick from its own seed: the demos do not depend on completion order
            rng = random.Random(f"{self.seed}:{seeds[i] if seeds else i}")
            ids = (self.tok.encode(self._reply(list(p), rng), add_special_tokens=False) + [stop_token_ids[0]])[:n]
            out.append(Generation(ids, [0.0] * len(ids), "stop" if ids[-1] in stop_token_ids else "length"))
        return out
