"""Segments -> training tensors: one row per segment (a window: docs/method.md, 'Windows are the
samples'); rows spread over the ranks by tokens, grouped into mini-batches by rollout, and packed
without padding into micro-batches by a token budget.

A row is a dict of 1-D tensors aligned with the targets (T = L − 1: position t predicts token
t + 1) plus the segment's reward and ids; the trainer adds old log-probs, values, advantages and
returns to it.
"""
import heapq

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


def pack(ids, per_token=()):
    """Windows -> one packed row, with no padding: `ids` (list of 1-D (L_w,)) concatenated to
    input_ids (1, N), N = Σ L_w, and position_ids (1, N) restarting at 0 in each window, which is
    what tells the attention (model.PACKED_ATTENTION) where a window starts. Each per-token tensor
    (list of 1-D (L_w − 1,), aligned with the window's targets) is laid out on the packed row's
    N − 1 target positions: a window's targets, then one 0 at the position whose target would be
    the next window's first token (it is in no loss). Returns (input_ids, position_ids,
    [(1, N − 1) per per_token list])."""
    input_ids = torch.cat(list(ids))[None]
    position_ids = torch.cat([torch.arange(len(x)) for x in ids])[None]
    packed = []
    for xs in per_token:
        parts = [t for x in xs for t in (x, x.new_zeros(1))]
        packed.append(torch.cat(parts[:-1])[None])
    return input_ids, position_ids, packed


def unpack(x, lengths):
    """(1, N − 1) per-token outputs of a packed row -> list of (L_w − 1,), one per window."""
    out, start = [], 0
    for n in lengths:
        out.append(x[0, start:start + n - 1])
        start += n
    return out


def micro_batches(rows, idx, max_tokens, device, keys=()):
    """Pack rows[idx] into micro-batches of at most `max_tokens` tokens, each one packed row
    (`pack`); every rank gets the same number of micro-batches (collectives must line up:
    docs/method.md, 'Token-level normalization'), the missing ones as 2-token dummies with
    nothing in the loss (mb None)."""
    mbs = [[idx[i] for i in mb] for mb in pack_micro_batches([len(rows[i]["ids"]) for i in idx], max_tokens)]
    n = int(fsdp.all_reduce(len(mbs), dist.ReduceOp.MAX))
    for mb in mbs + [None] * (n - len(mbs)):
        if mb is None:
            yield None, {"input_ids": torch.zeros(1, 2, dtype=torch.long, device=device),
                         "position_ids": torch.arange(2, device=device)[None],
                         "mask": torch.zeros(1, 1, device=device)}
            continue
        keys_here = ("mask",) + tuple(keys)
        ids, pos, packed = pack([rows[i]["ids"] for i in mb], [[rows[i][k] for i in mb] for k in keys_here])
        batch = {"input_ids": ids.to(device), "position_ids": pos.to(device)}
        batch.update({k: t.to(device) for k, t in zip(keys_here, packed)})
        yield mb, batch


def pack_micro_batches(lengths, max_tokens):
    """Group row indices into few micro-batches of at most `max_tokens` tokens, balanced: k
    micro-batches (one per row longer than the budget, which is alone in its own, and
    ⌈their tokens / max_tokens⌉ for the other rows; k + 1, ... when those cannot hold every row)
    each take the longest remaining row into the least filled one, so they end up near equal and
    no micro-batch is a small remainder. Each micro-batch lists its rows in index order."""
    if not lengths:
        return []
    long = sum(n > max_tokens for n in lengths)
    k = long + max(1, -(-sum(n for n in lengths if n <= max_tokens) // max_tokens))
    while (bins := balance_groups(lengths, k, max_tokens)) is None:
        k += 1
    out = [[] for _ in range(k)]
    for i, b in enumerate(bins):  # in index order
        out[b].append(i)
    return [mb for mb in out if mb]


def balance_groups(sizes, n_bins, capacity=None):
    """The bin of each item: greedy largest-first (LPT), each item to the least loaded bin (lowest
    index on ties), which keeps the largest load within 4/3 of the optimum. None when an item
    does not fit its bin under `capacity` (an item alone in a bin always fits)."""
    loads = [(0, b) for b in range(n_bins)]  # a heap of (load, bin)
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, b = heapq.heappop(loads)
        if capacity is not None and load and load + sizes[i] > capacity:
            return None
        out[i] = b
        heapq.heappush(loads, (load + sizes[i], b))
    return out


def assign_groups(rows, key="group_id"):
    """Redistribute rows over the ranks so that each rank holds about the same number of tokens
    (no rank then waits for another at the collectives of scoring and updating), moving whole
    groups: every window of a rollout stays together (cross-window GAE needs them all) and so
    does every rollout of a task group (estimator G compares them). A collective; every rank
    computes the same assignment. Returns this rank's rows, ordered by (group, rollout, window)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return rows
    tokens = {}
    for r in rows:
        tokens[r[key]] = tokens.get(r[key], 0) + len(r["ids"])
    everyone = [None] * world
    dist.all_gather_object(everyone, sorted(tokens.items()))
    groups = sorted(g for part in everyone for g in part)  # [(group, tokens)], the same everywhere
    dest = dict(zip((g for g, _ in groups), balance_groups([t for _, t in groups], world)))
    mine = []
    for d in range(world):  # one gather per destination: a rank receives only its own rows
        received = [None] * world if rank == d else None
        dist.gather_object([r for r in rows if dest[r[key]] == d], received, dst=d)
        if rank == d:
            mine = [r for part in received for r in part]
    return sorted(mine, key=lambda r: (r[key], r["rollout_id"], r["segment_index"]))


def minibatch_indices(rows, n):
    """Split this rank's rollouts (not segments: siblings stay together) into n mini-batches."""
    rids = sorted({r["rollout_id"] for r in rows})
    chunks = [rids[i * len(rids) // n:(i + 1) * len(rids) // n] for i in range(n)]
    return [[i for i, r in enumerate(rows) if r["rollout_id"] in set(c)] for c in chunks]
