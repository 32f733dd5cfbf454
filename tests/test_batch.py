"""batch.py: packed rows and their inverse, token-budgeted micro-batches, and the largest-first
balancing of rows over ranks against the brute-force optimum.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_batch.py
"""
import itertools
import random

import pytest
import torch

import batch


def test_pack_lays_windows_end_to_end_and_unpack_inverts_it():
    windows = [torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([1, 2, 3, 4])]
    masks = [torch.tensor([1.0, 0.0]), torch.tensor([1.0]), torch.tensor([0.0, 1.0, 1.0])]
    ids, pos, (mask,) = batch.pack(windows, [masks])
    assert ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # target t is token t + 1: the targets 8 and 1 belong to the next window and are in no loss
    assert mask.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0]]
    assert [m.tolist() for m in batch.unpack(mask, [3, 2, 4])] == [m.tolist() for m in masks]


@pytest.mark.parametrize("seed", range(20))
def test_micro_batches_hold_every_row_once_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    budget = rng.choice([64, 256, 1000, 5000])
    mbs = batch.pack_micro_batches(lengths, budget)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    assert all(mb == sorted(mb) for mb in mbs)
    for mb in mbs:
        assert sum(lengths[i] for i in mb) <= budget or len(mb) == 1
    # never more micro-batches than rows over the budget plus what the rest needs, twice over
    long = sum(n > budget for n in lengths)
    rest = sum(n for n in lengths if n <= budget)
    assert len(mbs) <= long + max(1, 2 * -(-rest // budget))


def test_micro_batches_are_balanced_not_a_full_one_and_a_remainder():
    mbs = batch.pack_micro_batches([100] * 5, 300)
    assert sorted(len(mb) for mb in mbs) == [2, 3]


def brute_force_makespan(sizes, n_bins):
    return min(max(sum(s for s, b in zip(sizes, bins) if b == k) for k in range(n_bins))
               for bins in itertools.product(range(n_bins), repeat=len(sizes)))


@pytest.mark.parametrize("seed", range(30))
def test_largest_first_balance_is_within_its_bound_of_the_optimum(seed):
    """LPT's largest load is at most (4/3 − 1/(3m)) of the optimum (Graham 1969); every item is
    placed once; with as many bins as items, each gets its own."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 8))]
    n_bins = rng.randint(1, 3)
    bins = batch.balance_groups(sizes, n_bins)
    assert len(bins) == len(sizes) and all(0 <= b < n_bins for b in bins)
    loads = [sum(s for s, b in zip(sizes, bins) if b == k) for k in range(n_bins)]
    assert max(loads) <= (4 / 3 - 1 / (3 * n_bins)) * brute_force_makespan(sizes, n_bins) + 1e-9
    assert sorted(batch.balance_groups(sizes, len(sizes))) == list(range(len(sizes)))


def test_balance_under_a_capacity_says_when_it_does_not_fit():
    assert batch.balance_groups([5, 5, 5], 2, capacity=9) is None
    assert batch.balance_groups([5, 5, 5], 2, capacity=15) is not None
    assert batch.balance_groups([50], 1, capacity=10) == [0]  # alone in its bin, it fits
