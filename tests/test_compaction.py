"""compaction.py: the trigger (eq. 7), the K cap, and the resume context (eq. 9).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_compaction.py
"""
import random

import pytest

from compaction import (SUMMARY_INSTRUCTION, build_resume_context, can_compact, resume_text,
                        select_tail, should_compact)


def test_trigger_boundaries():
    C, reserve = 100, 20
    assert not should_compact(80, C, reserve)  # 20 left: not below the reserve
    assert should_compact(81, C, reserve)  # 19 left
    assert not should_compact(0, C, reserve)
    assert should_compact(150, C, reserve)  # already past the budget
    with pytest.raises(ValueError, match="reserve"):
        should_compact(10, 100, 100)
    with pytest.raises(ValueError, match="used_tokens"):
        should_compact(-1, 100, 10)


def test_k_cap():
    assert [can_compact(n, 3) for n in range(5)] == [True, True, True, False, False]
    assert not can_compact(0, 0)  # K = 0: single window
    with pytest.raises(ValueError):
        can_compact(0, -1)


def test_summary_instruction_asks_for_every_part():
    for word in ("Goal", "Done", "Key observations", "exact file paths", "error", "Open problems",
                 "State", "Next steps"):
        assert word in SUMMARY_INSTRUCTION


def test_resume_text_repeats_task_only_when_asked():
    assert "FIX BUG 7" in resume_text("FIX BUG 7", " the summary ")
    assert "FIX BUG 7" not in resume_text("FIX BUG 7", "the summary", repeat_task=False)
    assert "the summary\n" in resume_text("t", " the summary ")
    assert resume_text("T", " S ", template="{task}|{summary}") == "T|S"  # a task's own message


def test_tail_shrinks_until_it_fits():
    # head 50, steps of 10/20/30, C=100, reserve 20 -> at most 30 tokens of tail
    assert select_tail(50, [10, 20, 30], 100, 20, keep_last=2) == 1  # 20+30 > 30; 30 fits
    assert select_tail(50, [10, 30, 40], 100, 20, keep_last=2) == 0  # not even the last step
    assert select_tail(40, [10, 20, 20], 100, 20, keep_last=2) == 2  # 40 fits exactly
    assert select_tail(40, [10, 20, 20], 100, 20, keep_last=5) == 2  # 50 does not
    assert select_tail(90, [1], 100, 20) is None  # the head alone leaves less than the reserve
    assert select_tail(10, [], 100, 20) == 0


def count_chars(messages):
    """A toy token counter: 1 token per 4 characters of each message, plus 3 per message."""
    return sum(3 + len(m["content"]) // 4 for m in messages)


def make_steps(rng, n):
    return [[{"role": "assistant", "content": f"cmd{i} " + "a" * rng.randint(0, 200)},
             {"role": "user", "content": f"out{i} " + "o" * rng.randint(0, 400)}] for i in range(n)]


@pytest.mark.parametrize("seed", range(30))
def test_resume_context_never_exceeds_budget_and_keeps_whole_steps(seed):
    rng = random.Random(seed)
    steps = make_steps(rng, rng.randint(0, 6))
    C, reserve = rng.randint(150, 600), rng.randint(10, 100)
    summary = "s" * rng.randint(0, 800)
    msgs, k = build_resume_context("SYS", "TASK", summary, steps, count_chars, C, reserve, keep_last=2)
    if msgs is None:
        head = [{"role": "system", "content": "SYS"},
                {"role": "user", "content": resume_text("TASK", summary)}]
        assert should_compact(count_chars(head), C, reserve)
        return
    assert not should_compact(count_chars(msgs), C, reserve)  # room left for the next response
    assert 0 <= k <= 2
    tail = msgs[2:]
    assert len(tail) == 2 * k  # whole atomic steps only
    assert tail == [m for s in steps[len(steps) - k:] for m in s] if k else tail == []
    # keeping one more step would not have fit (k is maximal), unless we hit keep_last or ran out
    if k < min(2, len(steps)):
        bigger = msgs[:2] + [m for s in steps[len(steps) - k - 1:] for m in s]
        assert should_compact(count_chars(bigger), C, reserve)
