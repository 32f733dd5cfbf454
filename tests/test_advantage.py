"""Estimators of advantage.py against slow, obviously correct references.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_advantage.py
The references loop explicitly over rollouts, segments and tokens with Python floats.
"""
import math
import random

import pytest
import torch

from advantage import (adaptive_lambda, concatenated_gae, cross_trajectory_gae, group_advantage,
                       masked_whiten, rollout_lengths, segment_gae)



@pytest.fixture(autouse=True)
def float64_default():
    """The references compare in float64; restore the default so other test files are unaffected."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def random_batch(seed, max_rollouts=5, max_segments=4, T=12, gamma_lam_per_row=False):
    """Rows of several rollouts, in shuffled order, with observation gaps and padding."""
    rng = random.Random(seed)
    rows = []
    for r in range(rng.randint(1, max_rollouts)):
        R = rng.choice([0.0, 1.0, rng.uniform(-1, 2)])
        for k in range(rng.randint(1, max_segments)):
            length = rng.randint(1, T)
            mask = [1.0 if rng.random() < 0.6 else 0.0 for _ in range(length)] + [0.0] * (T - length)
            mask[rng.randrange(length)] = 1.0  # at least one trainable token
            rows.append((r + 100, k, R, mask))
    rng.shuffle(rows)
    rollout_ids = torch.tensor([x[0] for x in rows])
    seg = torch.tensor([x[1] for x in rows])
    rewards = torch.tensor([x[2] for x in rows])
    mask = torch.tensor([x[3] for x in rows])
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(len(rows), T, generator=g)
    return values, mask, rewards, rollout_ids, seg


# --- slow references ---------------------------------------------------------------------------

def trainable(values, mask, b):
    return [(t, values[b, t].item()) for t in range(mask.shape[1]) if mask[b, t] > 0]


def gae_list(vals, R, gamma, lam, bootstrap=None):
    """Plain GAE over a list of values; terminal δ = R − V, or γ·bootstrap − V if given."""
    out, a = [0.0] * len(vals), 0.0
    for i in reversed(range(len(vals))):
        if i == len(vals) - 1:
            delta = R - vals[i] if bootstrap is None else gamma * bootstrap[0] - vals[i]
            a = delta + (0.0 if bootstrap is None else gamma * lam * bootstrap[1])
        else:
            a = gamma * vals[i + 1] - vals[i] + gamma * lam * a
        out[i] = a
    return out


def segments_of(rollout_ids, seg):
    by = {}
    for b in range(len(rollout_ids)):
        by.setdefault(rollout_ids[b].item(), {})[seg[b].item()] = b
    return {r: [d[k] for k in sorted(d)] for r, d in by.items()}


def ref_segment(values, mask, rewards, gamma, lam, n_after=None):
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        pos = trainable(values, mask, b)
        lam_b = lam[b].item() if torch.is_tensor(lam) else lam
        loc = gae_list([v for _, v in pos], rewards[b].item(), gamma, lam_b)
        w = 1.0 if n_after is None else (gamma * lam_b) ** n_after[b].item()
        for (t, _), a in zip(pos, loc):
            adv[b, t] = w * a
    return adv


def ref_concatenated(values, mask, rewards, rollout_ids, seg, gamma, lam):
    adv = torch.zeros_like(values)
    for r, rows in segments_of(rollout_ids, seg).items():
        flat = [(b, t, v) for b in rows for t, v in trainable(values, mask, b)]
        lam_r = lam[rows[0]].item() if torch.is_tensor(lam) else lam
        a = gae_list([v for _, _, v in flat], rewards[rows[-1]].item(), gamma, lam_r)
        for (b, t, _), x in zip(flat, a):
            adv[b, t] = x
    return adv


def ref_n_after(mask, rollout_ids, seg):
    n_after, total = [], []
    for b in range(len(rollout_ids)):
        same = [j for j in range(len(rollout_ids)) if rollout_ids[j] == rollout_ids[b]]
        n_after.append(sum(mask[j].sum().item() for j in same if seg[j] > seg[b]))
        total.append(sum(mask[j].sum().item() for j in same))
    return torch.tensor(n_after).long(), torch.tensor(total).long()


# --- against the references ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 0.5)])
def test_estimators_match_references(seed, gamma, lam):
    values, mask, rewards, rid, seg = random_batch(seed)
    n_after, total = rollout_lengths(mask, rid, seg)
    ref_na, ref_tot = ref_n_after(mask, rid, seg)
    assert torch.equal(n_after, ref_na) and torch.equal(total, ref_tot)

    adv_p, ret_p = cross_trajectory_gae(values, mask, rewards, n_after, gamma, lam)
    torch.testing.assert_close(adv_p, ref_segment(values, mask, rewards, gamma, lam, n_after))
    adv_n, ret_n = segment_gae(values, mask, rewards, gamma, lam)
    torch.testing.assert_close(adv_n, ref_segment(values, mask, rewards, gamma, lam))
    # the critic target is the LOCAL return, for P as for N
    torch.testing.assert_close(ret_p, (adv_n + values) * mask)
    torch.testing.assert_close(ret_n, (adv_n + values) * mask)
    adv_e, ret_e = concatenated_gae(values, mask, rewards, rid, seg, gamma, lam)
    torch.testing.assert_close(adv_e, ref_concatenated(values, mask, rewards, rid, seg, gamma, lam))
    torch.testing.assert_close(ret_e, (adv_e + values) * mask)
    for a in (adv_p, ret_p, adv_n, adv_e, ret_e):  # observation and padding positions are 0
        assert (a[mask == 0] == 0).all()


@pytest.mark.parametrize("seed", range(10))
def test_per_row_lambda_from_rollout_length(seed):
    values, mask, rewards, rid, seg = random_batch(seed)
    n_after, total = rollout_lengths(mask, rid, seg)
    lam = adaptive_lambda(total)  # one λ per rollout, repeated on its rows
    adv, _ = cross_trajectory_gae(values, mask, rewards, n_after, 1.0, lam)
    torch.testing.assert_close(adv, ref_segment(values, mask, rewards, 1.0, lam, n_after))
    adv_e, _ = concatenated_gae(values, mask, rewards, rid, seg, 1.0, lam)
    torch.testing.assert_close(adv_e, ref_concatenated(values, mask, rewards, rid, seg, 1.0, lam))


# --- identities of docs/method.md, 'Cross-trajectory GAE' ---------------------------------------

@pytest.mark.parametrize("seed", range(10))
def test_gamma_lambda_one_gives_R_minus_V(seed):
    values, mask, rewards, rid, seg = random_batch(seed)
    n_after, _ = rollout_lengths(mask, rid, seg)
    expected = (rewards[:, None] - values) * mask
    for adv in (cross_trajectory_gae(values, mask, rewards, n_after, 1.0, 1.0)[0],
                segment_gae(values, mask, rewards, 1.0, 1.0)[0],
                concatenated_gae(values, mask, rewards, rid, seg, 1.0, 1.0)[0]):
        torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("seed", range(10))
def test_one_segment_is_ordinary_gae(seed):
    values, mask, rewards, rid, seg = random_batch(seed, max_segments=1)
    n_after, _ = rollout_lengths(mask, rid, seg)
    assert (n_after == 0).all()
    p = cross_trajectory_gae(values, mask, rewards, n_after, 0.99, 0.9)[0]
    e = concatenated_gae(values, mask, rewards, rid, seg, 0.99, 0.9)[0]
    n = segment_gae(values, mask, rewards, 0.99, 0.9)[0]
    torch.testing.assert_close(p, e)
    torch.testing.assert_close(p, n)


@pytest.mark.parametrize("seed", range(10))
def test_zero_values_discount_by_distance_to_rollout_end(seed):
    """V ≡ 0: Â(k,i) = R·(γλ)^D(k,i) with D the trainable tokens after (k,i) in the rollout (eq. 15),
    which is exactly the concatenated GAE."""
    gamma, lam = 0.98, 0.9
    _, mask, rewards, rid, seg = random_batch(seed)
    values = torch.zeros_like(mask)
    n_after, _ = rollout_lengths(mask, rid, seg)
    p = cross_trajectory_gae(values, mask, rewards, n_after, gamma, lam)[0]
    expected = torch.zeros_like(mask)
    for b in range(len(rid)):
        pos = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        for j, t in enumerate(pos):
            D = n_after[b].item() + len(pos) - 1 - j
            expected[b, t] = rewards[b].item() * (gamma * lam) ** D
    torch.testing.assert_close(p, expected)
    torch.testing.assert_close(p, concatenated_gae(values, mask, rewards, rid, seg, gamma, lam)[0])


@pytest.mark.parametrize("seed", range(10))
def test_last_segment_is_plain_gae(seed):
    values, mask, rewards, rid, seg = random_batch(seed)
    n_after, _ = rollout_lengths(mask, rid, seg)
    last = n_after == 0
    p = cross_trajectory_gae(values, mask, rewards, n_after, 0.99, 0.9)[0]
    n = segment_gae(values, mask, rewards, 0.99, 0.9)[0]
    torch.testing.assert_close(p[last], n[last])
    assert not torch.allclose(p[~last], n[~last]) or (~last).sum() == 0


def test_correction_survives_long_rollouts():
    """(γλ)^N for N = 10^5 must neither overflow nor turn into NaN."""
    mask = torch.ones(1, 4)
    adv, _ = cross_trajectory_gae(torch.zeros(1, 4), mask, torch.ones(1), torch.tensor([100_000]),
                                  1.0, 0.9999)
    torch.testing.assert_close(adv[0, -1], torch.tensor(0.9999 ** 100_000))


# --- group-relative (G) -------------------------------------------------------------------------

def test_group_advantage_counts_rollouts_not_segments():
    # group 0: rollout 1 (R=1, 3 segments) and rollout 2 (R=0, 1 segment); group 1: rollout 3 alone
    rid = torch.tensor([1, 1, 1, 2, 3])
    gid = torch.tensor([0, 0, 0, 0, 1])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    mask = torch.tensor([[1.0, 0.0, 1.0]] * 5)
    adv = group_advantage(mask, rewards, gid, rid)
    # over rollouts: mean 0.5, population std 0.5 -> ±1; a segment-weighted mean would be 0.75
    eps = 1e-6
    expected = torch.tensor([1, 1, 1, -1, 0.0]) * 0.5 / (0.5 + eps)
    torch.testing.assert_close(adv, expected[:, None] * mask)


@pytest.mark.parametrize("seed", range(10))
def test_group_advantage_matches_reference(seed):
    _, mask, rewards, rid, seg = random_batch(seed, max_rollouts=8)
    gid = rid % 3
    adv = group_advantage(mask, rewards, gid, rid)
    per_rollout = {}
    for b in range(len(rid)):
        per_rollout[rid[b].item()] = (gid[b].item(), rewards[b].item())
    for b in range(len(rid)):
        rs = [R for g, R in per_rollout.values() if g == gid[b].item()]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((x - mean) ** 2 for x in rs) / len(rs))
        a = (rewards[b].item() - mean) / (std + 1e-6)
        torch.testing.assert_close(adv[b], a * mask[b])


# --- λ and whitening ----------------------------------------------------------------------------

def test_adaptive_lambda():
    torch.testing.assert_close(adaptive_lambda(torch.tensor([1.0, 10.0, 1000.0])),
                               torch.tensor([1 - 1 / 1.5, 1 - 1 / 15, 1 - 1 / 1500]))
    with pytest.raises(ValueError, match=">= 1"):
        adaptive_lambda(torch.tensor([0.0, 5.0]))
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambda(1, alpha=0.5)


def test_masked_whiten_uses_masked_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    w = masked_whiten(x, mask)
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ref = (vals - vals.mean()) / vals.std(unbiased=False)
    torch.testing.assert_close(w[mask > 0], ref, atol=1e-6, rtol=1e-6)
    assert (w[mask == 0] == 0).all()


# --- bad input ----------------------------------------------------------------------------------

def test_bad_inputs_name_the_problem():
    values, mask, rewards, rid, seg = random_batch(0, max_rollouts=3)
    n_after, _ = rollout_lengths(mask, rid, seg)
    with pytest.raises(ValueError, match="values and mask"):
        segment_gae(values[:, :-1], mask, rewards, 1.0, 0.9)
    with pytest.raises(ValueError, match="rewards"):
        segment_gae(values, mask, rewards[:-1], 1.0, 0.9)
    for bad_lam in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="lam"):
            cross_trajectory_gae(values, mask, rewards, n_after, 1.0, bad_lam)
    with pytest.raises(ValueError, match="n_after"):
        cross_trajectory_gae(values, mask, rewards, -n_after - 1, 1.0, 0.9)
    empty = mask.clone()
    empty[0] = 0
    with pytest.raises(ValueError, match="segment 0 has no trainable token"):
        segment_gae(values, empty, rewards, 1.0, 0.9)
    with pytest.raises(ValueError, match="claims"):
        rollout_lengths(mask, rid, seg, n_tokens=mask.sum(1) + 1)
    if len(rid) > 1:
        with pytest.raises(ValueError, match="sibling"):
            rollout_lengths(mask[1:], rid[1:], seg[1:] + 1)


def _whiten_on_rank(rank, init_file, segments, out_file):
    import datetime

    import torch.distributed as dist

    from advantage import whiten_segments
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    mine = segments if rank == 0 else []   # rank 1: every segment left the batch
    out = whiten_segments([a for a, _ in mine], [m for _, m in mine])
    if rank == 0:
        torch.save(out, out_file)
    dist.destroy_process_group()


def test_whitening_runs_on_a_rank_without_segments(tmp_path):
    """A rank with no segment still joins the all-reduce, and the result is the one-process one."""
    import torch.multiprocessing as mp
    g = torch.Generator().manual_seed(0)
    segments = [(torch.randn(n, generator=g, dtype=torch.float64), (torch.rand(n, generator=g) < 0.6).double())
                for n in (5, 9, 3)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_whiten_on_rank, args=(r, tmp_path / "pg", segments, tmp_path / "out.pt"))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and [p.exitcode for p in procs] == [0, 0], "a rank hung or failed in the collective"
    got = torch.load(tmp_path / "out.pt")
    x, m = torch.cat([a for a, _ in segments]), torch.cat([m for _, m in segments])
    torch.testing.assert_close(torch.cat(got), masked_whiten(x, m))
