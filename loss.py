"""PPO losses with token-level normalization — docs/method.md, 'Losses'; paper eq. (12).

Shape legend: B = segments in a micro-batch, T = token positions (aligned with the targets).
Every loss here returns a *sum* over tokens, never a mean: the caller divides by one global
denominator per optimizer step, so that any split into micro-batches and ranks optimizes the
same objective:

    Z   = Σ over every segment of every rollout in the mini-batch, on all ranks, of Σ_i m_i
    L_π = −(1/Z) Σ m · min(ρ·Â, clip(ρ, 1−ε_low, 1+ε_high)·Â)                      eq. (12)
    L_V =  (1/Z) Σ m · ½·max((V − G)², (V_old + clip(V − V_old, −ε_v, ε_v) − G)²)

Each micro-batch contributes `loss_sum / Z * world_size`; the ×world_size undoes the gradient
averaging that FSDP/DDP apply across ranks. Dividing by a per-micro-batch count instead is the
classic bug: with one segment per micro-batch a "token mean" silently becomes a segment mean.
"""
import torch

NORMALIZERS = ("token", "segment", "rollout")


def ppo_policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.28,
                    dual_clip=None, token_weights=None):
    """Clipped PPO surrogate (Schulman et al. 2017, arXiv:1707.06347, eq. 7), asymmetric clip
    range (DAPO, arXiv:2503.14476) and optional dual-clip for Â < 0 (Ye et al. 2020, arXiv:1912.09729).

    logprobs, old_logprobs, advantages, mask: (B, T). token_weights: optional (B, T) extra
    per-token weight (the `segment`/`rollout` normalizers of `normalizer_weights`).
    Returns (loss_sum, metrics): loss_sum = Σ m·w·ℓ (a scalar to divide by the global
    denominator) and metric *sums* over masked tokens, to be added up across micro-batches and
    ranks before dividing by the token count (see `finalize_metrics`).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    m = mask.to(logprobs.dtype)
    w = m if token_weights is None else m * token_weights
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)  # ρ
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)  # −min(ρÂ, clip(ρ)Â), eq. (12)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        # Â < 0: cap the loss at −c·Â so a huge ratio cannot produce an unbounded update.
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    loss_sum = (loss * w).sum()
    with torch.no_grad():
        lr = log_ratio.detach()
        rd = ratio.detach()
        metrics = {
            "tokens": m.sum(),
            "clipfrac": ((loss_clipped > loss_unclipped).to(m.dtype) * m).sum(),
            # k3 estimator of KL(π_old ‖ π_θ), Schulman 2020 "Approximating KL divergence"
            "approx_kl": ((rd - 1.0 - lr) * m).sum(),
            "ratio": (rd * m).sum(),
            "ratio_max": torch.where(m.bool(), rd, torch.full_like(rd, -torch.inf)).max(),
            "ratio_min": torch.where(m.bool(), rd, torch.full_like(rd, torch.inf)).min(),
        }
    return loss_sum, metrics


def value_loss(values, old_values, returns, mask, clip=0.2, token_weights=None):
    """Clipped value regression: ½·max((V − G)², (V_old + clip(V − V_old, −ε_v, ε_v) − G)²).

    values, old_values, returns, mask: (B, T). `clip=None` disables clipping.
    Returns (loss_sum, metrics) like `ppo_policy_loss`.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = mask.to(values.dtype)
    w = m if token_weights is None else m * token_weights
    err = (values - returns) ** 2
    if clip is None:
        loss = 0.5 * err
        clipped = torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_clip)
        clipped = err_clip > err
    metrics = {"tokens": m.sum(), "clipfrac": (clipped.to(m.dtype) * m).sum().detach()}
    return (loss * w).sum(), metrics


def normalizer_weights(mask, rollout_ids, kind="token"):
    """Per-token weights w and the local denominator D for a mini-batch, so that
    loss = Σ_ranks Σ w·ℓ / Σ_ranks D implements the chosen normalization:

        token    w = 1,            D = Σ m (trainable tokens)          paper eq. (12)
        segment  w = 1 / n_k,      D = number of segments              mean of segment means
        rollout  w = 1 / T_r,      D = number of distinct rollouts     mean of rollout means

    T_r counts the rollout's trainable tokens present in this mini-batch; all segments of a
    rollout live on one rank, so summing D over ranks counts each rollout once.
    mask: (B, T); rollout_ids: (B,). Rows with no trainable token (padding dummies) get weight 0
    and are not counted.
    """
    if kind not in NORMALIZERS:
        raise ValueError(f"unknown normalizer {kind!r}; expected one of {NORMALIZERS}")
    m = mask.to(torch.float64)
    n = m.sum(dim=1)  # (B,)
    real = n > 0
    if kind == "token":
        return torch.ones_like(mask, dtype=torch.float32), n.sum()
    if kind == "segment":
        w_row = torch.where(real, 1.0 / n.clamp(min=1), torch.zeros_like(n))
        return (w_row[:, None].expand_as(m)).float(), real.sum().to(torch.float64)
    uniq, inv = torch.unique(rollout_ids, return_inverse=True)
    t_roll = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, n)  # (rollouts,)
    w_row = torch.where(real, 1.0 / t_roll[inv].clamp(min=1), torch.zeros_like(n))
    return (w_row[:, None].expand_as(m)).float(), (t_roll > 0).sum().to(torch.float64)


def finalize_metrics(sums, prefix):
    """Turn summed metrics (already reduced across micro-batches and ranks) into means."""
    n = max(float(sums["tokens"]), 1.0)
    out = {f"{prefix}/tokens": float(sums["tokens"])}
    for k, v in sums.items():
        if k == "tokens":
            continue
        out[f"{prefix}/{k}"] = float(v) if k.endswith(("_max", "_min")) else float(v) / n
    return out


def _check_same_shape(**tensors):
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"shape mismatch: {shapes}")
