"""Segments -> padded training tensors: one row per segment (a window: docs/method.md, 'Windows are
the samples'), packed into
micro-batches by a token budget, grouped into mini-batches by rollout.

A row is a dict of 1-D tensors aligned with the targets (T = L − 1: position t predicts token
t + 1) plus the segment's reward and ids; the trainer adds old log-probs, values, advantages and
returns to it.
"""
import torch
import torch.distributed as dist

import fsdp


def to_rows(segments, summaries):
    """Per-segment 1-D tensors; per-token ones are aligned with the targets (T = L − 1)."""
    rows = []
    for s in segments:
        p, n = len(s.prompt_ids), len(s.ids)
        mask = torch.zeros(n - 1)
        mask[p - 1:] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if summaries == "masked":  # ablation: summary tokens out of the loss (and of N_after)
            for kind, a, b in s.spans:
                if kind == "summary":
                    mask[p - 1 + a:p - 1 + b] = 0
        lps = torch.zeros(n - 1)
        lps[p - 1:] = torch.tensor(s.logprobs, dtype=torch.float32)
        rows.append({"ids": torch.tensor(s.ids), "mask": mask, "sampler_logprobs": lps,
                     "reward": s.reward, "rollout_id": s.rollout_id, "segment_index": s.segment_index})
    return rows


def pad(tensors, value=0.0):
    """List of 1-D tensors -> (B, max len), right-padded."""
    out = torch.full((len(tensors), max(len(t) for t in tensors)), value, dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, :len(t)] = t
    return out


def micro_batches(rows, idx, max_tokens, pad_id, device, keys=()):
    """Pack rows[idx] by the token budget; every rank gets the same number of micro-batches
    (collectives must line up: docs/method.md, 'Token-level normalization'), the missing ones as
    fully masked dummies (None)."""
    mbs = [[idx[i] for i in mb] for mb in pack_micro_batches([len(rows[i]["ids"]) for i in idx], max_tokens)]
    n = int(fsdp.all_reduce(len(mbs), dist.ReduceOp.MAX))
    for mb in mbs + [None] * (n - len(mbs)):
        if mb is None:
            ids = torch.full((1, 2), pad_id, dtype=torch.long)
            yield None, {"input_ids": ids.to(device), "attention": torch.ones_like(ids).to(device),
                         "mask": torch.zeros(1, 1, device=device)}
            continue
        ids = pad([rows[i]["ids"] for i in mb], pad_id)
        attn = pad([torch.ones(len(rows[i]["ids"]), dtype=torch.long) for i in mb])
        batch = {"input_ids": ids.to(device), "attention": attn.to(device)}
        for k in ("mask",) + tuple(keys):
            batch[k] = pad([rows[i][k] for i in mb]).to(device)
        yield mb, batch


def pack_micro_batches(lengths, max_tokens):
    """Group row indices into micro-batches whose padded size (rows × longest row) stays within
    `max_tokens`: rows sorted by length, so each micro-batch holds rows of similar length and
    padding stays low. A row longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def minibatch_indices(rows, n):
    """Split this rank's rollouts (not segments: siblings stay together) into n mini-batches."""
    rids = sorted({r["rollout_id"] for r in rows})
    chunks = [rids[i * len(rids) // n:(i + 1) * len(rids) // n] for i in range(n)]
    return [[i for i, r in enumerate(rows) if r["rollout_id"] in set(c)] for c in chunks]
