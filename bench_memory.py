"""The memory plan (memory_plan.py) against the peaks real runs reach: train.py on CPU for a few
small configurations, each phase's measured peak in the last step (metrics memory/<phase>:
memory_plan.PeakMeter), when every state exists (step 0 updates both models, so Adam's moments are
there), against the plan's figure for the same configuration at the sizes that step reached
(metrics batch/longest_window and batch/micro_batch_tokens).

    python bench_memory.py                  # 3 configurations, a few minutes on 2 cores
    python bench_memory.py --configs one    # one of them

Prints, per configuration and phase: measured GiB, planned GiB, measured ÷ planned (goal: within
0.8-1.2), and the plan's own worst-case bound for the run's flags (longest window C + caps,
micro-batch at its budget), which is what train.py checks before it starts. The runs use a random-
initialized Qwen3-style model (no warm-up), so every turn runs to its length cap and windows
fill up; MALLOC_MMAP_THRESHOLD_=65536 makes the resident set follow the tensors (PeakMeter).
"""
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    # name: (ranks, build_tiny_model arguments, train.py flags)
    "one": (1, dict(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1536),
            ["--context-budget", "768", "--reserve", "128", "--max-action-tokens", "128", "--max-summary-tokens", "32",
             "--micro-batch-tokens", "2400", "--rollouts-per-step", "6"]),
    "two-ckpt": (2, dict(hidden_size=384, num_layers=6, num_heads=6, intermediate_size=1536),
                 ["--context-budget", "768", "--reserve", "128", "--max-action-tokens", "128",
                  "--max-summary-tokens", "32", "--micro-batch-tokens", "2400", "--rollouts-per-step", "8",
                  "--activation-checkpointing"]),
    "wide-long": (1, dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=2048),
                  ["--context-budget", "1536", "--reserve", "192", "--max-action-tokens", "192",
                   "--max-summary-tokens", "32", "--micro-batch-tokens", "1024", "--rollouts-per-step", "4"]),
}


@dataclass
class Config:
    configs: tuple[str, ...] = tuple(CONFIGS)
    """Which configurations to run."""


def run(name, work):
    import torch

    sys.path.insert(0, ROOT)
    import memory_plan
    import train
    from model import build_tiny_model, hf_config
    from train import tiny_corpus

    ranks, shape, flags = CONFIGS[name]
    model = build_tiny_model(os.path.join(work, name + "-model"), tiny_corpus(), max_positions=8192, **shape)
    out = os.path.join(work, name)
    args = ["train.py", "--model", model, "--out-dir", out, "--warmup-steps", "0", "--value-pretrain-steps", "0",
            "--steps", "2", "--save-every", "0", "--no-export-hf", "--mini-batches", "1", "--max-turns", "6"] + flags
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    p = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{name}: train.py failed\n{p.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    cfg = train.parse_config(args[1:])
    bound = train.memory_setup(cfg, ranks, gpu=False)
    shapes = memory_plan.model_shapes(hf_config(model))
    pairs = memory_plan.metered(shapes, bound, last)
    worst = memory_plan.peaks(memory_plan.plan(shapes, bound)[0], bound)
    print(f"\n{name}: {ranks} rank(s), {shapes.params / 1e6:.1f}M-parameter actor, longest window "
          f"{last['batch/longest_window']:.0f}, largest micro-batch {last['batch/micro_batch_tokens']:.0f} tokens, "
          f"activation checkpointing "
          f"{'on' if cfg.model.activation_checkpointing else 'off'}, torch {torch.__version__}")
    print(f"{'phase':<8} {'measured':>9} {'planned':>9} {'ratio':>6} {'bound':>9}   (GiB)")
    ratios = {}
    for p, (measured, planned) in pairs.items():
        ratios[p] = measured / planned
        print(f"{p:<8} {measured / 2**30:9.3f} {planned / 2**30:9.3f} {ratios[p]:6.2f} {worst[p] / 2**30:9.3f}")
    return ratios


def main(cfg):
    with tempfile.TemporaryDirectory() as work:
        ratios = {name: run(name, work) for name in cfg.configs}
    flat = [r for rs in ratios.values() for r in rs.values()]
    print(f"\nmeasured ÷ planned over {len(flat)} phases: min {min(flat):.2f}, max {max(flat):.2f}; "
          f"within 20%: {sum(0.8 <= r <= 1.2 for r in flat)} of {len(flat)}")


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
