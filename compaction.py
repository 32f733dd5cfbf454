"""Context compaction policy — docs/method.md, 'Rollouts with compaction'; paper eqs. (7)–(9).

    trigger  (eq. 7)   compact when  C − |h| < T_comp      (budget left below the reserve)
    summary  (eq. 8)   S ~ π_θ(· | h ⊕ q_sum)               the same trainable policy writes it
    resume   (eq. 9)   h̄ = s ⊕ u_resume(S) ⊕ z_{t−k+1} … z_t

Everything here is pure: it works on chat messages, token counts and a token-counting function,
so it is testable without a model. rollout.py applies the same rules to token ids.
An atomic step z = (action, observation) is never split: the tail keeps whole steps only.

Departures from the paper (which does not publish its texts): the summary instruction and the
resume message are ours; whether the task is repeated in u_resume is not stated, so it is a
flag (`repeat_task`, default True: safer for the agent).
"""

SUMMARY_INSTRUCTION = """\
Your context window is nearly full. Write a summary of the work so far; it will replace the \
whole conversation, and you will continue from it with no other memory. Include:
1. Goal: the original task, in your own words, with every requirement.
2. Done: the actions taken so far and their results.
3. Key observations: exact file paths, function names, error messages, values, test names.
4. Open problems: what failed or is still unresolved.
5. State: what the code and environment look like now (files edited, and how).
6. Next steps: what to do next, in order.
Reply with the summary only; do not run a command."""

RESUME_WITH_TASK = """\
{task}

You already worked on this task; your context was compacted. Summary of your progress so far:
{summary}

Continue from here."""

RESUME_SUMMARY_ONLY = """\
You are continuing a task; your context was compacted. Summary of your progress so far:
{summary}

Continue from here."""


def should_compact(used_tokens, budget, reserve):
    """Eq. (7): True when the context budget left, C − |h|, is below the reserve T_comp."""
    if budget <= 0 or reserve < 0 or reserve >= budget:
        raise ValueError(f"need 0 <= reserve < budget, got budget={budget}, reserve={reserve}")
    if used_tokens < 0:
        raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")
    return budget - used_tokens < reserve


def can_compact(n_compactions, max_compactions):
    """At most K compactions per rollout (paper: K = 3, i.e. up to 4 windows); K = 0 is the
    single-window setting."""
    if max_compactions < 0:
        raise ValueError(f"max_compactions must be >= 0, got {max_compactions}")
    return n_compactions < max_compactions


def resume_text(task, summary, repeat_task=True, template=""):
    """u_resume(S) of eq. (9): the user message that opens the next window. `template` (with
    {task} and {summary}) replaces the default texts, e.g. a task's own shorter one."""
    template = template or (RESUME_WITH_TASK if repeat_task else RESUME_SUMMARY_ONLY)
    return template.format(task=task, summary=summary.strip())


def select_tail(head_tokens, step_tokens, budget, reserve, keep_last=2):
    """How many of the most recent atomic steps fit after the head (eq. 9's k).

    head_tokens: length of s ⊕ u_resume(S); step_tokens: lengths of z_1 … z_t in order.
    Starts from k = keep_last and shrinks k until head + tail leaves at least the reserve free,
    so the new window does not trigger compaction again at once. Returns k, or None when not
    even the head alone fits (the rollout cannot continue).
    """
    if keep_last < 0 or any(n < 0 for n in step_tokens) or head_tokens < 0:
        raise ValueError("select_tail: lengths and keep_last must be >= 0")
    for k in range(min(keep_last, len(step_tokens)), -1, -1):
        tail = sum(step_tokens[len(step_tokens) - k:]) if k else 0
        if not should_compact(head_tokens + tail, budget, reserve):
            return k
    return None
