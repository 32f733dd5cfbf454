"""One critic + policy update of train.py's machinery on a FIXED global batch of segments, under
torchrun with any number of ranks; rank 0 saves the gradients and the updated weights.

    torchrun --standalone --nproc_per_node=2 tests/dist_check.py OUT.pt MODEL_DIR

tests/test_train.py runs it with 1 and 2 ranks and checks that both give the same result, and that
the gradient equals that of the global token-mean loss computed in one plain pass.
"""
import os
import random
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import batch  # noqa: E402
import fsdp  # noqa: E402
import train  # noqa: E402
from config import make  # noqa: E402
from rollout import Segment  # noqa: E402


def fixed_segments(vocab, n_rollouts=7, seed=0):
    """Rollouts of 1–3 segments with random ids, masks with observation gaps, and rewards."""
    rng = random.Random(seed)
    segs = []
    for r in range(n_rollouts):
        reward = float(rng.random() < 0.5)
        for k in range(rng.randint(1, 3)):
            s = Segment(prompt_ids=[rng.randrange(3, vocab) for _ in range(rng.randint(2, 9))],
                        rollout_id=r, segment_index=k, reward=reward)
            for _ in range(rng.randint(1, 4)):
                n = rng.randint(1, 6)
                s.append([rng.randrange(3, vocab) for _ in range(n)], "action", [-1.0] * n)
                s.append([rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))], "observation")
            segs.append(s)
    return segs


class GradRecorder:
    """Stands in for the optimizer in `train.optimize`: records the full gradients, changes nothing."""

    def __init__(self, module):
        self.module, self.grads = module, None

    def step(self):
        self.grads = {n: p.grad.full_tensor().clone() for n, p in self.module.named_parameters()}

    def zero_grad(self, set_to_none=True):
        self.module.zero_grad(set_to_none=set_to_none)


def checkpointed_layer_calls(module, vocab):
    """Calls of each decoder layer in one forward and backward (a collective: every rank, in step),
    and the number of layers. A checkpointed layer runs twice: in the forward, and again in the
    backward to recompute its activations."""
    calls = [0]
    layers = fsdp.decoder_layers(module)
    hooks = [layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for layer in layers]
    ids = torch.randint(3, vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    out = module(ids, torch.arange(12).repeat(2)[None])  # a packed row of two windows
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    module.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return {"calls": calls[0], "layers": len(layers), "training": all(m.training for m in module.modules())}


class StreamProbe:
    """A rollout engine in bfloat16 that records what a weight push hands it: each tensor's dtype,
    how many pushed tensors were alive at once, and whether the trainer's cached memory had been
    released before the first tensor came (the engine wakes its weights for a push)."""
    dtype = torch.bfloat16

    def __init__(self, released):
        self.released, self.dtypes, self.most_alive, self.released_first = released, set(), 0, None
        self.names = []

    def load_weights(self, named_tensors):
        import gc
        import weakref
        self.released_first = bool(self.released)
        alive = []
        for name, t in named_tensors:
            self.names.append(name)
            self.dtypes.add(str(t.dtype))
            alive = [r for r in alive if r() is not None] + [weakref.ref(t)]
            self.most_alive = max(self.most_alive, len(alive))
            del t
            gc.collect()


def pushed(actor, device):
    """What train.push_weights hands an engine, and the tensors themselves against the full state
    dict: {"dtypes", "most_alive", "released_first", "equal"}."""
    released = []
    real = fsdp.release_cached_memory
    fsdp.release_cached_memory = lambda: released.append(1)
    probe = StreamProbe(released)
    try:
        train.push_weights(actor, probe, device)
    finally:
        fsdp.release_cached_memory = real
    full = fsdp.full_state_dict(actor)
    streamed = dict(fsdp.iter_full_tensors(actor, device, torch.bfloat16))
    equal = list(streamed) == list(full) and all(torch.equal(streamed[k], full[k].to(torch.bfloat16)) for k in full)
    return {"dtypes": sorted(probe.dtypes), "most_alive": probe.most_alive, "released_first": probe.released_first,
            "equal": equal, "names": probe.names == [k.removeprefix("lm.") for k in full]}


def gather_to_rank0(obj):
    """[obj of rank 0, obj of rank 1, ...] on rank 0, None elsewhere."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def main(out_path, model_dir):
    rank, world, device = fsdp.init_distributed()
    # grad_clip off: the recorder must see the raw gradient, not the clipped one
    cfg = make(model=model_dir, micro_batch_tokens=48, entropy_coef=0.0, lam_mode="fixed",
               lam=0.9, gamma=1.0, grad_clip=1e9, activation_checkpointing=True)
    from model import load_tokenizer
    tok = load_tokenizer(model_dir)
    actor, critic = train.make_models(cfg, model_dir, device)
    checkpointed = gather_to_rank0({name: checkpointed_layer_calls(m, len(tok))
                                    for name, m in (("actor", actor), ("critic", critic))})
    push = gather_to_rank0(pushed(actor, device))
    segs = fixed_segments(len(tok))
    # every rollout starts on rank 0; batch.assign_groups spreads them over the ranks by tokens
    rows = batch.to_rows(segs if rank == 0 else [], "trained")
    for r in rows:
        r["group_id"] = r["rollout_id"]
    rows = batch.assign_groups(rows)
    tokens = {}  # {rollout: tokens} of this rank's rows
    for r in rows:
        tokens[r["rollout_id"]] = tokens.get(r["rollout_id"], 0) + len(r["ids"])
    assigned = gather_to_rank0(tokens)
    train.score(actor, critic, rows, cfg, device)
    train.advantages(rows, cfg, [r["rollout_id"] for r in rows])
    idx = list(range(len(rows)))
    rec = GradRecorder(actor)
    train.optimize(actor, rec, rows, idx, train.policy_loss_fn(cfg), cfg, device, ("old_logprobs", "advantages"))
    # SGD, not Adam: Adam's g / (√v + ε) turns the last-bit differences of a gradient near ε (1e-9
    # on some embedding rows, summed in another order on 2 ranks) into update differences of ~1e-5
    opt_a = torch.optim.SGD(actor.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.1)
    train.optimize(critic, opt_c, rows, idx, train.value_loss_fn(cfg), cfg, device, ("old_values", "returns"))
    train.optimize(actor, opt_a, rows, idx, train.policy_loss_fn(cfg), cfg, device, ("old_logprobs", "advantages"))
    actor_sd = fsdp.full_state_dict(actor, cpu_offload=True)
    critic_sd = fsdp.full_state_dict(critic, cpu_offload=True)
    # a non-finite advantage on ONE rank: every rank skips the step and the weights stay as they were
    if rank == world - 1 and rows:
        rows[0]["advantages"] = rows[0]["advantages"] * float("nan")
    _, stats, skipped = train.optimize(actor, opt_a, rows, idx, train.policy_loss_fn(cfg), cfg, device,
                                       ("old_logprobs", "advantages"))
    after = fsdp.full_state_dict(actor, cpu_offload=True)
    unchanged = all(torch.equal(after[k], actor_sd[k]) for k in actor_sd) if rank == 0 else None
    if rank == 0:
        torch.save({"grads": rec.grads, "actor": actor_sd, "critic": critic_sd,
                    "nan_step_skipped": skipped, "nan_step_unchanged": unchanged,
                    "checkpointed_calls": checkpointed, "push": push, "assigned": assigned}, out_path)
    fsdp.close_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
