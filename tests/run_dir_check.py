"""The run folder's collective parts under torchrun with any number of ranks: checkpoint manifests
hashed by all ranks, a damaged checkpoint skipped with every rank agreeing, and train.main's
start-up checks stopping every rank before any model is loaded.

    torchrun --standalone --nproc_per_node=2 tests/run_dir_check.py WORK_DIR

Each rank writes what it saw to WORK_DIR/rank<r>.json; tests/test_run_dir.py checks it.
"""
import importlib.util
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp  # noqa: E402
import rundir  # noqa: E402
import train  # noqa: E402
from config import make  # noqa: E402


class Pair(torch.nn.Sequential):
    _no_split_modules = ["Linear"]  # what fsdp.shard shards one by one


def trained_and_saved(root, steps):
    """A sharded two-layer model and its Adam, one step and one checkpoint per step. Returns the
    model, the optimizer and the full weights after each step."""
    torch.manual_seed(0)
    model = fsdp.shard(Pair(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), torch.device("cpu"), False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    weights = []
    for step in range(steps):
        model(torch.randn(4, 64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        fsdp.save_checkpoint(root, step, {"m": model}, {"m": opt}, {"step": step}, keep=5)
        weights.append({k: v.clone() for k, v in fsdp.full_state_dict(model).items()})
    return model, opt, weights


def flip_middle(path, n=4096):
    """Invert n bytes in the middle of a file, keeping its size."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        block = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))


def on_rank0_then_wait(fn):
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def outcome(fn):
    try:
        fn()
    except Exception as e:  # recorded for the test to read
        return f"{type(e).__name__}: {e}"
    return "no error"


def checkpoints(work, seen):
    root = os.path.join(work, "checkpoints")
    seen["empty_root"] = fsdp.latest_valid_checkpoint(root)
    model, opt, weights = trained_and_saved(root, 2)
    step0, step1 = fsdp.checkpoints(root)
    with open(os.path.join(step1, fsdp.MANIFEST)) as f:
        seen["manifest_files"] = sorted(json.load(f)["files"])
    seen["clean"] = fsdp.latest_valid_checkpoint(root)
    largest = max(os.listdir(step1), key=lambda n: os.path.getsize(os.path.join(step1, n)))
    seen["flipped"] = os.path.join(step1, largest)
    on_rank0_then_wait(lambda: flip_middle(seen["flipped"]))
    seen["after_flip"] = fsdp.latest_valid_checkpoint(root)
    seen["loaded_step"] = fsdp.load_checkpoint(seen["after_flip"], {"m": model}, {"m": opt})["step"]
    now = fsdp.full_state_dict(model)
    seen["loaded_step0_weights"] = all(torch.equal(now[k], weights[0][k]) for k in now)
    seen["truncated"] = os.path.join(step0, ".metadata")
    on_rank0_then_wait(lambda: os.truncate(seen["truncated"], 10))
    seen["none_valid"] = outcome(lambda: fsdp.latest_valid_checkpoint(root))
    on_rank0_then_wait(lambda: os.remove(os.path.join(step0, fsdp.MANIFEST)))
    seen["no_manifest"] = fsdp.verify_checkpoint(step0)


def start_up_checks(work, seen):
    """train.main on bad input: each error must come before make_models."""
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the start-up checks failed")
    train.make_models = no_model
    empty = os.path.join(work, "empty.jsonl")
    on_rank0_then_wait(lambda: open(empty, "w").close())
    held = os.path.join(work, "held")
    on_rank0_then_wait(lambda: (os.makedirs(held), rundir.write_config(held, {})))
    a_file = os.path.join(work, "a_file")
    on_rank0_then_wait(lambda: open(a_file, "w").close())
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name in ("tensorboard", "wandb") else find_spec(name, *a)
    cases = {"empty_tasks": dict(preset="swe", task="swe", tasks=empty, warmup_steps=0),
             "prompt_too_long": dict(preset="swe", task="swe", warmup_steps=0, context_budget=1024, reserve=512,
                                     max_action_tokens=512, allow_unisolated=True),
             "tensorboard": dict(tensorboard=True),
             "held": dict(out_dir=held),
             "resume_nothing": dict(resume=True),
             "unwritable": dict(out_dir=os.path.join(a_file, "run"))}
    for name, flags in cases.items():
        cfg = make(**{"out_dir": os.path.join(work, name), "rollouts_per_step": 8, **flags})
        seen[name] = outcome(lambda: train.main(cfg))
    importlib.util.find_spec = find_spec


def main(work):
    rank, _, _ = fsdp.init_distributed()
    seen = {}
    checkpoints(work, seen)
    start_up_checks(work, seen)
    with open(os.path.join(work, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f, indent=1)
    fsdp.close_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
