"""Distributed plumbing: process group, FSDP2 sharding, full-weight gathering, DCP checkpoints
verified on load by a manifest of their files' hashes.

One code path from `python train.py` (a world of one) to `torchrun` on many GPUs/nodes:
gloo on CPU, nccl on GPU. Public torch APIs only (`fully_shard`, `torch.distributed.checkpoint`).
"""
import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import rundir

logger = logging.getLogger(__name__)


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
    aborts the process ("terminate called without an active exception", SIGABRT, now and then; the
    thread waits in take_gil under ~AsyncAllgatherCoalescedWork; pytorch PR 179291). The barrier
    and the sleep give those threads the GIL while the interpreter is alive."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    time.sleep(0.1)


def fail_together(fn, rank0_only=False):
    """Run fn on every rank (or on rank 0 alone) and return its result; if it raised on any rank,
    raise on every rank. A check that fails on one rank must stop them all, not leave the others
    waiting at the next collective. The raising rank keeps its own exception."""
    error, result = None, None
    if dist.get_rank() == 0 or not rank0_only:
        try:
            result = fn()
        except Exception as e:  # shared with the other ranks below, then raised
            error = e
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
    if failed:
        raise RuntimeError(f"rank {failed[0][0]} failed: {failed[0][1]}")
    return result


def decoder_layers(module):
    """The transformer blocks to shard one by one: HF models name their block classes in
    `_no_split_modules` (a public attribute used for device maps)."""
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    # the class or a base: fully_shard swaps a module's class for a subclass (FSDP<name>)
    layers = [m for m in module.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"no decoder layers found in {type(module).__name__} "
                         f"(looked for classes {sorted(names)})")
    return layers


def shard(module, device, mixed_precision, activation_checkpointing=False, cpu_offload=False):
    """fully_shard each decoder layer, then the root. The root owns the embeddings,
    final norm and heads; its forward gathers them once per call. cpu_offload: the sharded fp32
    parameters, their gradients and hence the optimizer's states live in host memory (pinned on
    a GPU machine: FSDP2 moves them there when it first runs), and the optimizer steps there."""
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    if activation_checkpointing:
        for m in module.modules():
            if hasattr(m, "gradient_checkpointing_enable"):
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                break
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
    return module


def load_sharded(build, device, mixed_precision, activation_checkpointing=False, cpu_offload=False):
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
    # Training mode on every rank: from_pretrained returns a model in eval mode (rank 0) and
    # from_config one in training mode (the others), and transformers checkpoints a layer's
    # activations only in training mode.
    module.train()
    module = shard(module, device, mixed_precision, activation_checkpointing, cpu_offload)
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


def iter_full_tensors(module, device, dtype):
    """(name, full tensor) for each entry of the module's state dict, one at a time: the local
    shard is moved to `device` (from the host, with CPU offload) and cast to `dtype` (the
    receiver's), then gathered. A collective: every rank must iterate in step, to the end. Only
    the tensor being yielded is held here, so what a weight push adds to memory is its largest
    tensor, not a copy of the model."""
    for name, t in module.state_dict().items():
        t = t.detach()
        yield name, _gather_rows(t, device, dtype) if isinstance(t, DTensor) else t.to(device=device, dtype=dtype)


def _gather_rows(t, device, dtype):
    """The full tensor of an FSDP2 shard (rows split over a 1-D mesh as torch.chunk splits them: the
    first ranks ceil(n/W) rows each), gathered in one all-gather straight into its own buffer.
    DTensor.full_tensor would hold two full copies at once."""
    if t.device_mesh.ndim != 1 or [p.dim for p in t.placements if p.is_shard()] != [0]:
        raise ValueError(f"expected an FSDP2 shard of rows over one mesh dimension, got {t.placements}")
    local = t.to_local().to(device=device, dtype=dtype)
    world, n = t.device_mesh.size(), t.shape[0]
    rows = -(-n // world)
    if local.shape[0] != rows:  # the last ranks hold fewer rows (or none): pad to the common size
        local = torch.cat([local, local.new_zeros(rows - local.shape[0], *t.shape[1:])])
    out = local.new_empty(rows * world, *t.shape[1:])
    _ALL_GATHER_SINGLE(out, local.contiguous(), group=t.device_mesh.get_group())
    return out[:n]


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def release_cached_memory():
    """Return the blocks torch's CUDA caching allocator keeps but no tensor uses to the device,
    so another allocator (vLLM's, waking its weights and KV cache) can have them. A no-op on CPU."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


# --- checkpoints ------------------------------------------------------------------------------

MANIFEST = "manifest.json"
"""Inside each checkpoint: every other file's relative path, size and sha256, written last."""


def save_checkpoint(root, step, models, optimizers, extra, keep=3):
    """DCP checkpoint of models + optimizers, plus per-rank `extra` (RNG states, data position).

    Written to `step_N.tmp`, then the manifest (written last), then renamed to `step_N` only
    after every rank finished: a crash while saving never corrupts the latest complete
    checkpoint, and bytes damaged later are caught by `verify_checkpoint`. Keeps the last `keep`.
    A failed write (a full disk) raises on every rank, naming the folder and the free space.
    """
    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    try:
        fail_together(lambda: _fresh_folder(tmp), rank0_only=True)
        dcp.save(_state(models, optimizers), checkpoint_id=tmp)  # raises on every rank if one fails
        fail_together(lambda: torch.save(extra, os.path.join(tmp, f"extra_rank{rank}.pt")))
        write_manifest(tmp)
        fail_together(lambda: _publish(tmp, final, root, keep), rank0_only=True)
    except (OSError, RuntimeError, dcp.CheckpointException) as e:
        raise RuntimeError(f"writing the checkpoint {tmp} failed with {rundir.free_bytes(root)} bytes free on "
                           f"its disk (is it full?): {type(e).__name__}: {e}") from e
    return final


def _publish(tmp, final, root, keep):
    """Rank 0: rename the finished folder into place, then drop all but the last `keep`. A step
    folder already there was skipped as invalid on resume (latest_valid_checkpoint)."""
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _fresh_folder(path):
    shutil.rmtree(path, ignore_errors=True)  # a half-written one from a killed save
    os.makedirs(path)


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


def checkpoints(root):
    """The complete checkpoint folders in root (`step_N`, no `.tmp`), oldest first."""
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, d) for d in sorted(os.listdir(root)) if re.fullmatch(r"step_\d+", d)]


def latest_valid_checkpoint(root):
    """The newest checkpoint in root that passes `verify_checkpoint`; None if root holds none.
    A newer one that fails is skipped with a loud warning; if every one fails, raises naming the
    folder and each bad file. A collective: every rank gets the same answer."""
    problems = []
    for path in reversed(checkpoints(root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        problems.append(problem)
        if dist.get_rank() == 0:
            msg = f"checkpoint {path} is invalid and is skipped: {problem}"
            print(f"WARNING: {msg}", file=sys.stderr, flush=True)
            logger.warning(msg)
    if problems:
        raise RuntimeError(f"no valid checkpoint in {root}:\n  " + "\n  ".join(problems))
    return None


def write_manifest(folder):
    """Hash every file of `folder` and write MANIFEST there. A collective: rank r hashes files
    r, r+W, ..., rank 0 gathers the results and writes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = [_files(folder) if rank == 0 else None]
    dist.broadcast_object_list(files, src=0)  # one listing, the same on every rank
    mine = fail_together(lambda: {rel: {"size": os.path.getsize(os.path.join(folder, rel)),
                                        "sha256": _sha256(os.path.join(folder, rel))}
                                  for rel in files[0][rank::world]})
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    entries = {rel: e for part in gathered or [] for rel, e in part.items()}
    fail_together(lambda: rundir.write_json_atomic(os.path.join(folder, MANIFEST), {"files": entries}),
                  rank0_only=True)


def verify_checkpoint(folder):
    """None if every file in folder's manifest has its recorded size and sha256, else what is
    wrong, naming the file. A collective: rank r hashes files r, r+W, ...; the first bad file is
    agreed by an all-reduce, so every rank returns the same answer."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            entries = json.load(f)["files"]
    except FileNotFoundError:
        return (f"{folder} has no {MANIFEST}, so it cannot be verified (written by a version of "
                f"save_checkpoint that did not write one, or not by save_checkpoint)")
    except (json.JSONDecodeError, KeyError) as e:
        return f"{os.path.join(folder, MANIFEST)} is unreadable ({e})"
    names = sorted(entries)
    rank, world = dist.get_rank(), dist.get_world_size()
    first_bad = next((i for i in range(rank, len(names), world)
                      if _file_problem(folder, names[i], entries[names[i]], hash=True)), len(names))
    first_bad = int(all_reduce(first_bad, dist.ReduceOp.MIN))
    if first_bad == len(names):
        return None
    name = names[first_bad]  # sizes are cheap to re-check; a file of the right size has the wrong hash
    problem = _file_problem(folder, name, entries[name], hash=False) or "its sha256 differs from the manifest"
    return f"{os.path.join(folder, name)}: {problem}"


def _file_problem(folder, rel, entry, hash):
    path = os.path.join(folder, rel)
    if not os.path.isfile(path):
        return "missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{size} bytes where the manifest says {entry['size']} (truncated?)"
    if hash and _sha256(path) != entry["sha256"]:
        return "its sha256 differs from the manifest"
    return None


def _files(folder):
    """Every file under folder but the manifest, as sorted relative paths."""
    found = [os.path.relpath(os.path.join(d, n), folder) for d, _, names in os.walk(folder) for n in names]
    return sorted(f for f in found if f != MANIFEST)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_checkpoint(path, models, optimizers):
    """Load a `save_checkpoint` directory in place; returns this rank's `extra`. Pick `path` with
    `latest_valid_checkpoint`, which verifies it."""
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
