"""The built-in long-horizon memory task: the CPU default, made so that compaction must fire and
only summaries that carry the key can earn reward.

An episode (every line after the task is one atomic step z = (action, observation)):

    system  "Remember the key. When asked, answer with the key."      user "Task: memory."
    action → "key C"            the key, shown once, in the first observation
    action → "noise A" …        n_noise distractor steps, symbols from the same alphabet
    action → "answer?"          the question
    answer                      reward 1 if the answer's first symbol is the key, else 0

Actions before the question are free (the environment ignores them). The context budget C is
sized (in train.py) so the episode does not fit in one window: compaction fires after a few
noise steps, the resume keeps the last k steps (the key is never among them), and the key
survives only if the policy's own summary carries it. With K = 0 compactions the budget runs out
and the reward is 0.

`p_short` mixes in short episodes whose question comes before any compaction (0 to
max_noise_short distractors, so the key's position varies and the policy must find it by content,
not by offset): they teach "answer with the key in context" without needing a summary, the
cheapest lever against the coordination saddle found in notes/toy-memory-task (RL only, no labels).
"""
import random

from env import Step

SYSTEM = "Remember the key; answer it when asked."
TASK = "Task: memory."
QUESTION = "answer?"
# The task's own, short summary instruction: the general one (compaction.SUMMARY_INSTRUCTION,
# ~150 tokens for the tiny tokenizer) would double the CPU cost of every compacting window.
SUMMARY_INSTRUCTION = "Context full. Write what you must remember."


def symbols(n):
    if not 2 <= n <= 26:
        raise ValueError(f"memory task: n_symbols must be in [2, 26], got {n}")
    return [chr(ord("A") + i) for i in range(n)]


def make_tasks(n, seed, n_keys=4, n_noise=6, p_short=0.0, max_noise_short=2):
    """n task rows: {"task_id", "key", "noise": [symbols]}; the key is uniform over n_keys."""
    rng = random.Random(seed)
    alphabet = symbols(n_keys)
    rows = []
    for i in range(n):
        steps = rng.randint(0, max_noise_short) if rng.random() < p_short else n_noise
        rows.append({"task_id": f"memory-{seed}-{i}", "key": rng.choice(alphabet),
                     "noise": [rng.choice(alphabet) for _ in range(steps)]})
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

    def step(self, action):
        self.turn += 1
        noise = self.row["noise"]
        if self.turn == 1:
            return Step(observation=f"key {self.row['key']}", done=False)
        if self.turn <= len(noise) + 1:
            return Step(observation=f"noise {noise[self.turn - 2]}", done=False)
        if self.turn == len(noise) + 2:
            return Step(observation=QUESTION, done=False)
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
    lines = [SYSTEM, TASK, QUESTION, SUMMARY_INSTRUCTION] * 50
    lines += [f"key {s}" for s in alphabet] * 5 + [f"noise {s}" for s in alphabet] * 5
    return lines


class FormatDemoEngine:
    """An engine that writes well-formed outputs with RANDOM content, for the format warm-up:
    actions "ok", summaries "key X" and answers "X", X a random key symbol each time.

    Supervised steps on these teach the tiny random model the *shape* of each turn (a symbol, then
    the stop token) without any information about the key: which symbols to write in the summary
    and the answer must still be learned by RL (see train.py's `format_warmup_steps`).
    """

    def __init__(self, tokenizer, n_keys, seed):
        self.tok = tokenizer
        self.keys = symbols(n_keys)
        self.rng = random.Random(seed)

    def _reply(self, prompt_tail):
        if prompt_tail.rstrip().endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant"):
            return self.rng.choice(self.keys)
        if SUMMARY_INSTRUCTION in prompt_tail:
            return f"key {self.rng.choice(self.keys)}"
        return "ok"

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids):
        from rollout import Generation
        out = []
        for p, n in zip(prompts, max_new_tokens):
            text = self._reply(self.tok.decode(p[-24:]))
            ids = (self.tok.encode(text, add_special_tokens=False) + [stop_token_ids[0]])[:n]
            out.append(Generation(ids, [0.0] * len(ids), "stop" if ids[-1] in stop_token_ids else "length"))
        return out
