"""loss.py: hand-computed values, micro-batch invariance of the token-level normalizer, and the
segment/rollout normalizer ablations against explicit loops.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_loss.py
"""
import math
import random

import pytest
import torch

from loss import finalize_metrics, normalizer_weights, ppo_policy_loss, value_loss


def test_policy_loss_hand_computed():
    # three tokens, one masked out; clip range [0.8, 1.28]
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 2.0]]))
    adv = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = ppo_policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # token 0: ρ=1.5, Â=1  -> −min(1.5, 1.28) = −1.28 (clipped)
    # token 1: ρ=0.5, Â=−2 -> −min(−1.0, 0.8·−2=−1.6) = 1.6 (clipped)
    torch.testing.assert_close(loss, torch.tensor(-1.28 + 1.6))
    assert m["tokens"] == 2 and m["clipfrac"] == 2
    torch.testing.assert_close(m["ratio"], torch.tensor(2.0))
    k3 = (1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5))
    torch.testing.assert_close(m["approx_kl"], torch.tensor(k3))
    assert m["ratio_max"] == 1.5 and m["ratio_min"] == 0.5


def test_dual_clip_caps_negative_advantage_loss():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[10.0, 10.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    mask = torch.ones(1, 2)
    plain, _ = ppo_policy_loss(new, old, adv, mask)
    dual, _ = ppo_policy_loss(new, old, adv, mask, dual_clip=3.0)
    # Â<0: plain loss is −min(−10, −0.8) = 10; dual clip caps it at 3. Â>0: −1.28 either way.
    torch.testing.assert_close(plain, torch.tensor(10.0 - 1.28))
    torch.testing.assert_close(dual, torch.tensor(3.0 - 1.28))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(new, old, adv, mask, dual_clip=0.5)


def test_value_loss_hand_computed():
    v = torch.tensor([[1.0, 0.0]])
    v_old = torch.tensor([[0.0, 0.0]])
    g = torch.tensor([[0.0, 2.0]])
    mask = torch.ones(1, 2)
    loss, m = value_loss(v, v_old, g, mask, clip=0.2)
    # token 0: max((1−0)², (0.2−0)²) = 1 ; token 1: max(4, 4) = 4  -> ½·5
    torch.testing.assert_close(loss, torch.tensor(2.5))
    assert m["clipfrac"] == 0
    loss2, m2 = value_loss(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.tensor([[1.0]]),
                           torch.ones(1, 1), clip=0.2)
    # unclipped (0.5−1)² = 0.25, clipped (0.2−1)² = 0.64 -> the pessimistic max
    torch.testing.assert_close(loss2, torch.tensor(0.32))
    assert m2["clipfrac"] == 1


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


# --- micro-batch invariance --------------------------------------------------------------------

def make_problem(seed, B=9, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask *= (torch.rand(B, T, generator=g) < 0.8).double()
    mask[:, 0] = 1.0
    old = -torch.rand(B, T, generator=g) * 2
    adv = torch.randn(B, T, generator=g)
    feats = torch.randn(B, T, generator=g)
    return mask, old, adv, feats


def policy_grad(theta, feats, old, adv, mask, rows, denom):
    """Σ_rows loss_sum / denom and its gradient for a toy policy log π = old + θ·feature."""
    logp = old[rows] + theta * feats[rows]
    loss, _ = ppo_policy_loss(logp, old[rows], adv[rows], mask[rows])
    return loss / denom


@pytest.mark.parametrize("seed", range(5))
def test_token_normalizer_is_invariant_to_micro_batching(seed):
    mask, old, adv, feats = make_problem(seed)
    B = mask.shape[0]
    theta0 = torch.tensor(0.3, dtype=torch.float64)
    Z = mask.sum()

    def full():
        th = theta0.clone().requires_grad_()
        loss = policy_grad(th, feats, old, adv, mask, list(range(B)), Z)
        loss.backward()
        return loss.detach(), th.grad

    ref_loss, ref_grad = full()
    rng = random.Random(seed)
    for _ in range(5):
        # any split into micro-batches, also over two simulated ranks whose gradients are averaged
        perm = list(range(B))
        rng.shuffle(perm)
        cuts = sorted(rng.sample(range(1, B), rng.randint(1, B - 1)))
        mbs = [perm[a:b] for a, b in zip([0] + cuts, cuts + [B])]
        world = 2
        ranks = [mbs[0::2], mbs[1::2]]
        th = theta0.clone().requires_grad_()
        total_loss, grads = 0.0, []
        for rank_mbs in ranks:
            th.grad = None
            for rows in rank_mbs:
                loss = policy_grad(th, feats, old, adv, mask, rows, Z) * world  # sum/Z·world_size
                loss.backward()
                total_loss += loss.detach() / world
            grads.append(th.grad.clone() if th.grad is not None else torch.zeros(()))
        avg_grad = sum(grads) / world  # what FSDP's gradient averaging does
        torch.testing.assert_close(total_loss, ref_loss)
        torch.testing.assert_close(avg_grad, ref_grad)


def test_naive_per_micro_batch_mean_is_not_the_token_mean():
    mask, old, adv, feats = make_problem(0)
    B = mask.shape[0]
    th = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    ref = policy_grad(th, feats, old, adv, mask, list(range(B)), mask.sum())
    ref.backward()
    ref_grad = th.grad.clone()
    th.grad = None
    naive = sum(policy_grad(th, feats, old, adv, mask, [b], mask[b].sum()) for b in range(B)) / B
    naive.backward()
    assert not torch.allclose(naive, ref.detach())
    assert not torch.allclose(th.grad, ref_grad)


# --- normalizer ablations ---------------------------------------------------------------------

def per_token_loss(mask, old, adv, feats):
    logp = old + 0.3 * feats
    ratio = torch.exp(logp - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))


@pytest.mark.parametrize("seed", range(5))
def test_normalizers_match_their_definitions(seed):
    mask, old, adv, feats = make_problem(seed)
    rid = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4])
    ell = per_token_loss(mask, old, adv, feats)
    logp = old + 0.3 * feats
    out = {}
    for kind in ("token", "segment", "rollout"):
        w, denom = normalizer_weights(mask, rid, kind)
        loss, _ = ppo_policy_loss(logp, old, adv, mask, token_weights=w)
        out[kind] = loss / denom
    # explicit loops
    tok = sum(ell[b, t] for b in range(9) for t in range(7) if mask[b, t]) / mask.sum()
    seg_means = [sum(ell[b, t] for t in range(7) if mask[b, t]) / mask[b].sum() for b in range(9)]
    roll_means = []
    for r in sorted(set(rid.tolist())):
        rows = [b for b in range(9) if rid[b] == r]
        roll_means.append(sum(ell[b, t] for b in rows for t in range(7) if mask[b, t])
                          / sum(mask[b].sum() for b in rows))
    torch.testing.assert_close(out["token"], tok)
    torch.testing.assert_close(out["segment"], sum(seg_means) / len(seg_means))
    torch.testing.assert_close(out["rollout"], sum(roll_means) / len(roll_means))
    assert not torch.allclose(out["token"], out["segment"])


def test_normalizer_ignores_padding_rows_and_rejects_unknown():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    w, d = normalizer_weights(mask, torch.tensor([0, 1]), "segment")
    assert d == 1 and (w[1] == 0).all()
    w, d = normalizer_weights(mask, torch.tensor([0, 1]), "rollout")
    assert d == 1 and (w[1] == 0).all()
    with pytest.raises(ValueError, match="unknown normalizer"):
        normalizer_weights(mask, torch.tensor([0, 1]), "batch")


def test_finalize_metrics_means_and_extrema():
    sums = {"tokens": torch.tensor(4.0), "clipfrac": torch.tensor(1.0), "ratio_max": torch.tensor(1.7)}
    out = finalize_metrics(sums, "policy")
    assert out == {"policy/tokens": 4.0, "policy/clipfrac": 0.25, "policy/ratio_max": pytest.approx(1.7)}
