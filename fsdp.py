"""Distributed plumbing: process group, FSDP2 sharding, full-weight gathering, DCP checkpoints.

One code path from `python train.py` (a world of one) to `torchrun` on many GPUs/nodes:
gloo on CPU, nccl on GPU. Public torch APIs only (`fully_shard`, `torch.distributed.checkpoint`).
"""
import os
import random
import shutil
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def init_distributed():
    """Join the process group torchrun describes; without torchrun, make a world of one so the
    same code (FSDP2, all-reduces) runs. Returns (rank, world_size, device)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port for the single-process rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def close_distributed():
    """Leave the process group on every rank, at the end of a run. A gloo worker thread drops its
    reference to a finished collective (freeing the tensors it holds) only after the caller has
    moved on, and freeing them takes the GIL: if the interpreter is finalizing by then, the thread
    aborts the process ("terminate called without an active exception", SIGABRT; 3 in 113 two-rank
    runs of tests/dist_check.py, gdb: take_gil under ~AsyncAllgatherCoalescedWork; pytorch PR
    179291). The barrier and the sleep give those threads the GIL while the interpreter is alive."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(0.1)


def decoder_layers(module):
    """The transformer blocks to shard one by one: HF models name their block classes in
    `_no_split_modules` (a public attribute used for device maps)."""
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    layers = [m for m in module.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"no decoder layers found in {type(module).__name__} "
                         f"(looked for classes {sorted(names)})")
    return layers


def shard(module, device, mixed_precision, activation_checkpointing=False):
    """fully_shard each decoder layer, then the root (SPEC §6). The root owns the embeddings,
    final norm and heads; its forward gathers them once per call."""
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    if activation_checkpointing:
        for m in module.modules():
            if hasattr(m, "gradient_checkpointing_enable"):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                break
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp)
    return module


def load_sharded(build, device, mixed_precision, activation_checkpointing=False):
    """Build a module on rank 0 from its checkpoint and on the other ranks on the meta device
    (no memory), shard it, then broadcast rank 0's weights into the shards. This is what lets a
    100B model load without every rank holding a full copy.

    build(meta: bool) -> nn.Module: real weights when meta is False, structure only when True.
    """
    rank = dist.get_rank()
    if rank == 0:
        module = build(False)
        full = {k: v.detach().clone() for k, v in module.state_dict().items()}
        buffers = {k: v.detach().clone() for k, v in module.named_buffers()}
    else:
        with torch.device("meta"):
            module = build(True)
        full, buffers = {}, {}
    module = shard(module, device, mixed_precision, activation_checkpointing)
    module.to_empty(device=device) if rank != 0 else module.to(device)
    set_model_state_dict(module, full, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
    # Non-persistent buffers (e.g. rotary inv_freq) are not in the state dict: broadcast them too.
    for name, buf in module.named_buffers():
        if rank == 0:
            buf.copy_(buffers[name].to(device))
        dist.broadcast(buf, src=0)
    return module


def full_state_dict(module, cpu_offload=False):
    """Unsharded weights on every rank (a collective: every rank must call it, in step)."""
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=cpu_offload))


def all_reduce(x, op=dist.ReduceOp.SUM):
    x = torch.as_tensor(x, dtype=torch.float64).clone()
    dist.all_reduce(x, op=op)
    return x


def rng_state():
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if torch.cuda.is_available() and state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root, step, models, optimizers, extra, keep=3):
    """DCP checkpoint of models + optimizers, plus per-rank `extra` (RNG states, data position).

    Written to `step_N.tmp` and renamed to `step_N` only after every rank finished, so a crash
    while saving never corrupts the latest complete checkpoint. Keeps the last `keep`.
    """
    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(_state(models, optimizers), checkpoint_id=tmp)
    torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt"))
    dist.barrier()
    if rank == 0:
        os.replace(tmp, final)
        done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    dist.barrier()
    return final


def _state(models, optimizers):
    """{name: {"model": sharded state dict[, "optim": ...]}}; a model without optimizer (a frozen
    reference) has weights only."""
    state = {}
    for name, model in models.items():
        if optimizers.get(name) is None:
            state[name] = {"model": get_model_state_dict(model)}
        else:
            msd, osd = get_state_dict(model, optimizers[name])
            state[name] = {"model": msd, "optim": osd}
    return state


def latest_checkpoint(root):
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    return os.path.join(root, done[-1]) if done else None


def load_checkpoint(path, models, optimizers):
    """Load a `save_checkpoint` directory in place; returns this rank's `extra`."""
    state = _state(models, optimizers)
    dcp.load(state, checkpoint_id=path)
    for name, model in models.items():
        if optimizers.get(name) is None:
            set_model_state_dict(model, state[name]["model"])
        else:
            set_state_dict(model, optimizers[name], model_state_dict=state[name]["model"],
                           optim_state_dict=state[name]["optim"])
    extra_path = os.path.join(path, f"extra_rank{dist.get_rank()}.pt")
    if not os.path.exists(extra_path):
        raise FileNotFoundError(f"{extra_path} missing: was the checkpoint written with another "
                                f"number of ranks?")
    return torch.load(extra_path, weights_only=False)
