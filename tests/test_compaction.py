"""compaction.py: the trigger (eq. 7), the K cap, and the resume context (eq. 9).

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_compaction.py
"""
import random

import pytest

from compaction import SUMMARY_INSTRUCTION, can_compact, resume_text, select_tail, should_compact


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


@pytest.mark.parametrize("seed", range(30))
def test_resume_tail_never_exceeds_budget_and_is_maximal(seed):
    """Eq. (9)'s k on token lengths, as rollout._compact calls it: the head s ⊕ u_resume(S) plus
    the last k whole steps leaves the reserve free, and one more step would not."""
    rng = random.Random(seed)
    steps = [rng.randint(1, 150) for _ in range(rng.randint(0, 6))]
    C, reserve = rng.randint(150, 600), rng.randint(10, 100)
    head = rng.randint(5, 400)
    k = select_tail(head, steps, C, reserve, keep_last=2)
    if k is None:
        assert should_compact(head, C, reserve)  # not even the head leaves the reserve
        return
    assert 0 <= k <= min(2, len(steps))
    assert not should_compact(head + sum(steps[len(steps) - k:]), C, reserve)  # room for the next response
    if k < min(2, len(steps)):  # keeping one more step would not have fit
        assert should_compact(head + sum(steps[len(steps) - k - 1:]), C, reserve)
