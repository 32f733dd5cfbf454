"""Advantage estimators for segmented (compacted) rollouts — paper eqs. (13)–(15); docs/method.md,
'Advantages'.

A rollout with compaction is split into segments (one per context window). Each segment is one
row of a padded batch. Shape legend:
    B = segments in the batch, T = token positions per row (padded).
    values  (B, T)  critic value V(k, i) at every position (only trainable positions are read)
    mask    (B, T)  1 on trainable (policy-sampled) tokens, 0 on prompt, observations, padding
    rewards (B,)    the rollout's outcome reward R, repeated on each of its segments
    n_after (B,)    N_after(k): trainable tokens in the later segments of the same rollout
    rollout_ids (B,), segment_index (B,): which rollout a row belongs to, and its window k
    gamma: float; lam: float or (B,) tensor (one λ per row, e.g. from `adaptive_lambda`)

GAE runs over trainable tokens only ("skip-observation GAE"): the next value of a trainable
token is the value at the next trainable token of the same row. Every output is 0 on positions
where mask is 0 (prompt, observations, padding).

Estimators (flag `estimator` in train.py):
    P  `cross_trajectory_gae`  the paper's: local GAE, R at every segment end, × (γλ)^N_after
    E  `concatenated_gae`      one GAE over the whole rollout, bootstrapping across boundaries
    N  `segment_gae`           naive per-segment GAE (the paper's "w/o cross-trajectory GAE")
    G  `group_advantage`       group-relative outcome advantage (SUPO / ReSum style)
"""
import math

import torch
import torch.distributed as dist


def adaptive_lambda(length, alpha=1.5):
    """Length-adaptive λ = 1 − 1/(α·l) (VAPO; paper §5.1 uses α = 1.5).

    length: number or tensor of lengths l ≥ 1 (by default the rollout's total trainable length T).
    """
    length = torch.as_tensor(length, dtype=torch.float64)
    if (length < 1).any():
        raise ValueError(f"adaptive_lambda: lengths must be >= 1, got min {length.min().item()}")
    if alpha * length.min().item() <= 1.0:
        raise ValueError(f"adaptive_lambda: alpha*l must be > 1 for lambda in (0, 1), "
                         f"got alpha={alpha}, min l={length.min().item()}")
    return 1.0 - 1.0 / (alpha * length)


def rollout_lengths(mask, rollout_ids, segment_index, n_tokens=None):
    """Per-row N_after(k) = Σ_{j>k} n_j and the rollout's total trainable length T = Σ_j n_j.

    All segments of every rollout in the batch must be present (docs/method.md, 'Windows are the
    samples'): indices 0..K-1 with no
    gaps or duplicates. `n_tokens` (B,), if given, is the trainable count each segment claims;
    a mismatch with `mask` is an error (it means tokens were lost between sampler and trainer).
    Returns (n_after, total), both (B,) int64.
    """
    _check_rows(mask, rollout_ids=rollout_ids, segment_index=segment_index)
    n = mask.sum(dim=1).long()  # (B,) n_k
    if n_tokens is not None:
        n_tokens = torch.as_tensor(n_tokens, device=n.device).long()
        bad = (n != n_tokens).nonzero().flatten()
        if len(bad):
            b = bad[0].item()
            raise ValueError(f"segment {b} claims {n_tokens[b].item()} trainable tokens but its mask "
                             f"has {n[b].item()}")
    _check_complete_rollouts(rollout_ids, segment_index)
    same = rollout_ids[:, None] == rollout_ids[None, :]  # (B, B)
    later = segment_index[None, :] > segment_index[:, None]  # (B, B): column j after row i
    n_after = ((same & later).long() * n[None, :]).sum(dim=1)  # (B,)
    total = (same.long() * n[None, :]).sum(dim=1)  # (B,)
    return n_after, total


def _masked_gae_scan(values, mask, rewards, gamma, lam, next_value=None, next_adv=None):
    """Backward GAE over the trainable tokens of each row (vectorized over rows).

    A row's last trainable token is terminal, δ = R − V, unless `next_value`/`next_adv` (B,) are
    given for it (NaN = none): then δ = γ·next_value − V and the recursion continues from
    next_adv, which is how `concatenated_gae` bootstraps across a segment boundary.
    Returns the advantages (B, T), 0 where mask is 0.
    """
    B, T = values.shape
    dtype = values.dtype
    lam = torch.as_tensor(lam, dtype=dtype, device=values.device).expand(B)
    R = rewards.to(dtype)
    m = mask.bool()
    has_next = torch.zeros(B, dtype=torch.bool, device=values.device)
    v_next = torch.zeros(B, dtype=dtype, device=values.device)
    a_next = torch.zeros(B, dtype=dtype, device=values.device)
    if next_value is not None:
        has_next = ~torch.isnan(next_value)
        v_next = torch.where(has_next, next_value.to(dtype), v_next)
        a_next = torch.where(has_next, next_adv.to(dtype), a_next)
    adv = torch.zeros_like(values)
    for t in reversed(range(T)):
        v = values[:, t]
        delta = torch.where(has_next, gamma * v_next - v, R - v)  # eq. (13): δ; terminal δ = R − V
        a = delta + torch.where(has_next, gamma * lam * a_next, torch.zeros_like(v))  # A = δ + γλA'
        mt = m[:, t]
        adv[:, t] = torch.where(mt, a, torch.zeros_like(a))
        v_next = torch.where(mt, v, v_next)
        a_next = torch.where(mt, a, a_next)
        has_next = has_next | mt
    return adv


def segment_gae(values, mask, rewards, gamma, lam):
    """N: naive per-segment GAE. Each segment ends in a terminal reward R, no correction.

    Returns (advantages, returns) (B, T); returns = A_loc + V on trainable tokens.
    """
    _check_gae_inputs(values, mask, rewards, gamma, lam)
    adv = _masked_gae_scan(values, mask, rewards, gamma, lam)  # eq. (13)
    return adv, (adv + values) * mask


def cross_trajectory_gae(values, mask, rewards, n_after, gamma, lam):
    """P: cross-trajectory GAE, the paper's estimator (eqs. 13–14).

        A_loc(k, i) = Σ_l (γλ)^l δ(k, i+l),  δ(k, n_k) = R − V(k, n_k)       eq. (13)
        Â(k, i)     = (γλ)^{N_after(k)} · A_loc(k, i)                         eq. (14)

    The reward term of Â(k, i) is then discounted by its distance, in trainable tokens, to the
    end of the whole rollout — as one GAE over the concatenated rollout would (eq. 15).
    Returns (advantages, returns): returns = A_loc + V, the critic's target (docs/method.md, 'The
    critic target': never regress
    on the corrected Â + V).
    """
    _check_gae_inputs(values, mask, rewards, gamma, lam)
    n_after = torch.as_tensor(n_after, device=values.device)
    if n_after.shape != rewards.shape:
        raise ValueError(f"n_after must have shape {tuple(rewards.shape)}, got {tuple(n_after.shape)}")
    if (n_after < 0).any():
        raise ValueError(f"n_after must be >= 0, got min {n_after.min().item()}")
    a_loc = _masked_gae_scan(values, mask, rewards, gamma, lam)  # eq. (13)
    weight = correction_factor(n_after, gamma, lam).to(values.dtype)  # (B,) eq. (14)
    return a_loc * weight[:, None], (a_loc + values) * mask


def correction_factor(n_after, gamma, lam):
    """(γλ)^N_after, eq. (14)'s factor: n_after (B,), lam a number or (B,). Returns (B,) float64.
    Computed as exp(N·log γλ): no overflow/underflow surprises for N in the 10^5 range."""
    n_after = torch.as_tensor(n_after)
    gl = gamma * torch.as_tensor(lam, dtype=torch.float64, device=n_after.device)
    return torch.exp(n_after.to(torch.float64) * torch.log(gl))


def concatenated_gae(values, mask, rewards, rollout_ids, segment_index, gamma, lam):
    """E: one GAE over all trainable tokens of a rollout in time order.

    At a segment boundary it bootstraps: δ(k, n_k) = γ·V(k+1, 1) − V(k, n_k) for k < K; only the
    rollout's last segment is terminal (δ = R − V). Segments are processed from the last window
    backwards, each level taking its carry from the first trainable token of the next segment.
    Returns (advantages, returns), returns = A + V.
    """
    _check_gae_inputs(values, mask, rewards, gamma, lam)
    _check_rows(mask, rollout_ids=rollout_ids, segment_index=segment_index)
    _check_complete_rollouts(rollout_ids, segment_index)
    B, T = values.shape
    lam_b = torch.as_tensor(lam, dtype=values.dtype, device=values.device).expand(B)
    first = _first_true(mask.bool())  # (B,) index of each row's first trainable token
    rows = torch.arange(B, device=values.device)
    adv = torch.zeros_like(values)
    # row index of the next segment of the same rollout, or -1
    same = rollout_ids[:, None] == rollout_ids[None, :]
    succ = same & (segment_index[None, :] == segment_index[:, None] + 1)  # (B, B)
    nxt = torch.where(succ.any(1), succ.float().argmax(1), torch.full_like(rows, -1))
    for k in range(int(segment_index.max().item()), -1, -1):
        sel = (segment_index == k).nonzero().flatten()
        nsel = nxt[sel]
        has = nsel >= 0
        nrow = nsel.clamp(min=0)
        nv = torch.where(has, values[nrow, first[nrow]], torch.full_like(values[sel, 0], math.nan))
        na = torch.where(has, adv[nrow, first[nrow]], torch.zeros_like(nv))
        adv[sel] = _masked_gae_scan(values[sel], mask[sel], rewards[sel], gamma, lam_b[sel], nv, na)
    return adv, (adv + values) * mask


def group_advantage(mask, rewards, group_ids, rollout_ids, eps=1e-6):
    """G: group-relative outcome advantage, (R − mean_g R) / (std_g R + ε), on every token.

    Statistics are over the DISTINCT rollouts of a group (a rollout that compacted three times
    counts once, not four times — paper §4.2). std is the population std (ddof 0), so a group
    with one rollout gets advantage 0. Returns advantages (B, T).
    """
    _check_rows(mask, rewards=rewards, group_ids=group_ids, rollout_ids=rollout_ids)
    uniq, first_idx = _first_occurrence(rollout_ids)  # one entry per distinct rollout
    r_roll = rewards[first_idx].to(torch.float64)
    g_roll = group_ids[first_idx]
    groups, g_of_roll = torch.unique(g_roll, return_inverse=True)
    count = torch.zeros(len(groups), dtype=torch.float64).index_add_(0, g_of_roll, torch.ones_like(r_roll))
    mean = torch.zeros_like(count).index_add_(0, g_of_roll, r_roll) / count
    var = torch.zeros_like(count).index_add_(0, g_of_roll, (r_roll - mean[g_of_roll]) ** 2) / count
    a_roll = (r_roll - mean[g_of_roll]) / (var.sqrt()[g_of_roll] + eps)  # (rollouts,)
    roll_of_row = torch.searchsorted(uniq, rollout_ids)
    return a_roll[roll_of_row].to(mask.dtype if mask.is_floating_point() else torch.float32)[:, None] * mask


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x − mean) / std over the tokens where mask is 1; statistics all-reduced across ranks
    when torch.distributed is initialized, so every rank whitens with the global mean and std."""
    m = mask.to(torch.float64)
    stats = torch.stack([m.sum(), (x * m).sum(), (x.to(torch.float64) ** 2 * m).sum()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    count, s1, s2 = stats
    if count < 1:
        raise ValueError("masked_whiten: no token is masked in")
    mean = s1 / count
    var = (s2 / count - mean ** 2).clamp(min=0.0)
    out = (x - mean) * torch.rsqrt(var + eps) if shift_mean else x * torch.rsqrt(var + eps)
    return (out * mask).to(x.dtype)


def whiten_segments(advantages, masks):
    """`masked_whiten` over a rank's segments, given as lists of (T_i,) advantages and masks, with
    the statistics of every rank's trainable tokens. A collective: every rank calls it, also one
    whose segments all left the batch (else the others would wait for it forever)."""
    x = torch.cat(advantages) if advantages else torch.zeros(0, dtype=torch.float64)
    m = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.float64)
    return list(masked_whiten(x, m).split([len(a) for a in advantages]))


# --- input checks: bad input fails loudly, naming the problem ---------------------------------

def _check_gae_inputs(values, mask, rewards, gamma, lam):
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(f"values and mask must both be (B, T); got {tuple(values.shape)} "
                         f"and {tuple(mask.shape)}")
    if rewards.shape != (values.shape[0],):
        raise ValueError(f"rewards must be (B,) = ({values.shape[0]},), got {tuple(rewards.shape)}")
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    lam_t = torch.as_tensor(lam)
    if lam_t.dim() > 0 and lam_t.shape != rewards.shape:
        raise ValueError(f"lam must be a float or a (B,) tensor, got shape {tuple(lam_t.shape)}")
    if ((lam_t <= 0) | (lam_t > 1)).any():
        raise ValueError(f"lam must be in (0, 1], got min {lam_t.min().item()} max {lam_t.max().item()}")
    empty = (mask.sum(dim=1) == 0).nonzero().flatten()
    if len(empty):
        raise ValueError(f"segment {empty[0].item()} has no trainable token in its mask; every "
                         f"segment must hold at least one sampled token")


def _check_rows(mask, **per_row):
    for name, t in per_row.items():
        if t.shape != (mask.shape[0],):
            raise ValueError(f"{name} must be (B,) = ({mask.shape[0]},), got {tuple(t.shape)}")
    if "segment_index" in per_row and (per_row["segment_index"] < 0).any():
        raise ValueError("segment_index must be >= 0")


def _check_complete_rollouts(rollout_ids, segment_index):
    """Every rollout must appear with segments 0..K-1 exactly once (N_after needs all of them)."""
    for r in torch.unique(rollout_ids).tolist():
        ks = sorted(segment_index[rollout_ids == r].tolist())
        if ks != list(range(len(ks))):
            raise ValueError(f"rollout {r} has segment indices {ks}; expected 0..{len(ks) - 1}, each "
                             f"once (all sibling segments must be in the batch)")


def _first_true(m):
    """(B, T) bool -> (B,) index of the first True of each row (rows are known to have one)."""
    T = m.shape[1]
    idx = torch.arange(T, device=m.device).expand_as(m)
    return torch.where(m, idx, torch.full_like(idx, T)).min(dim=1).values


def _first_occurrence(ids):
    """Sorted unique ids and, for each, the row index where it first appears."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    rows = torch.arange(len(ids), device=ids.device)
    first = torch.full((len(uniq),), len(ids), device=ids.device, dtype=torch.long)
    first = first.scatter_reduce(0, inv, rows, reduce="amin")
    return uniq, first
