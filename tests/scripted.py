"""Scripted agents for SWE tests: an Engine whose replies are shell commands chosen per task, so
an episode is known in advance (the gold patch applied, or nothing) and only the environment,
the sandboxes and the grading are under test."""
from env import SUBMIT_SENTINEL
from engine import Generation


class ScriptedAgent:
    """Replies to each episode with `script(row, turn)`, a shell command (turn 0, 1, ...), found
    by the problem statement in the prompt. Records the instances it was asked about."""

    def __init__(self, tok, rows, script):
        self.tok, self.rows, self.script, self.seen = tok, rows, script, []

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        out = []
        for prompt, n in zip(prompts, max_new_tokens):
            text = self.tok.decode(prompt)
            row = next(r for r in self.rows if r["problem_statement"].strip() in text)
            self.seen.append(row["instance_id"])
            turn = text.count("<|assistant|>") - 1   # the prompt ends with a generation prompt
            reply = f"Next step.\n```bash\n{self.script(row, turn)}\n```"
            ids = (self.tok.encode(reply, add_special_tokens=False) + [stop_token_ids[0]])[:n]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


def gold_script(row, turn):
    """The perfect agent: apply the gold patch from a heredoc, then submit."""
    return f"git apply <<'GOLD_EOF'\n{row['patch']}GOLD_EOF" if turn == 0 else f"echo {SUBMIT_SENTINEL}"


def submit_script(row, turn):
    """The agent that changes nothing: it submits at once (an empty patch)."""
    return f"echo {SUBMIT_SENTINEL}"


def gold_agent(tok, rows):
    return ScriptedAgent(tok, rows, gold_script)
