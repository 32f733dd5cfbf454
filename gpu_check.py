"""The at-scale path on one GPU, in a few minutes: train.py for 3 steps on a random-initialized
Qwen3-0.6B-shaped model (28 layers, hidden 1024, 16 heads / 8 KV heads of 128, MLP 3072, Qwen3's
151,936-token vocabulary, tied embeddings: 596M parameters) with the HF engine, bf16 mixed
precision, activation checkpointing and 16k-token windows, then a resumed run from its DCP
checkpoint. The tokenizer is the embedded tiny one (ids it does not know decode to nothing; the
memory task's padded observations make the windows long, so few tokens are sampled).

On a machine with one GPU, torch and transformers (vLLM is not needed), and this repository's
other dependencies (matplotlib, tqdm, numpy, safetensors, tokenizers, jinja2, and tyro with
docstring-parser and typeguard):

    python gpu_check.py            # prints the report; exit status 1 if a check fails
    python gpu_check.py --tiny     # the same path on a tiny model and 2k windows (CPU, half a minute)

Where nothing can be installed from a registry, bring the pure-Python ones as wheels, made on a
machine that can (for the GPU machine's Python, here 3.12):

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \\
        -d .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
    # on the GPU machine:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
        PYTHONPATH=/tmp/site python3 gpu_check.py

Prints: each phase's peak memory (metrics memory/<phase>: the CUDA allocator's peak) against the
memory plan at the sizes the step reached, and the plan's bound for the run's flags; the update's
throughput (tokens of the step's windows × passes ÷ seconds of the critic and actor updates); the
mean |log π_trainer − log π_sampler| on sampled tokens (policy/sampler_logprob_diff); whether the
resumed run continued from the checkpoint.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.abspath(__file__))
# Qwen3-0.6B's shape; the tiny one exercises the same path on a CPU
SHAPES = {False: dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=3072, vocab_size=151936),
          True: dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, intermediate_size=512, vocab_size=4096)}
# window = C + observation cap + summary cap + 1024 (config.max_model_len): 16384, or 2048 tiny
FLAGS = {False: ["--context-budget", "14272", "--memory-filler", "500", "--memory-noise", "30",
                 "--rollouts-per-step", "8", "--micro-batch-tokens", "16384"],
         True: ["--context-budget", "896", "--max-observation-tokens", "64", "--memory-filler", "20",
                "--memory-noise", "20", "--rollouts-per-step", "4", "--micro-batch-tokens", "2048"]}


@dataclass
class Config:
    tiny: bool = False
    """A tiny model and 2k windows: the same path on a CPU."""
    out_dir: str = "runs/gpu_check"
    """Where the model and both runs go (replaced)."""


def build_model(path, tiny):
    """The tiny tokenizer and chat template (model.build_tiny_model), with a random Qwen3 model of
    SHAPES[tiny] in place of the tiny model."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from model import build_tiny_model, load_tokenizer
    from train import tiny_corpus
    build_tiny_model(path, tiny_corpus())
    tok = load_tokenizer(path)
    cfg = Qwen3Config(**SHAPES[tiny], max_position_embeddings=32768, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    model.save_pretrained(path)
    return path


def train_py(args):
    # on a CPU the meter reads the resident set: let freed tensors leave it (memory_plan.PeakMeter)
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ,
           "PYTHONPATH": os.pathsep.join([ROOT] + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
    t0 = time.time()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py")] + args, cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"train.py {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout, time.time() - t0


def main(cfg):
    import torch
    import tyro

    sys.path.insert(0, ROOT)
    import memory_plan
    import train
    from config import max_model_len
    from model import hf_config
    t_start = time.time()
    shutil.rmtree(cfg.out_dir, ignore_errors=True)
    model = build_model(os.path.join(cfg.out_dir, "model"), cfg.tiny)
    run = os.path.join(cfg.out_dir, "run")
    args = ["--model", model, "--out-dir", run, "--engine", "hf", "--activation-checkpointing", "--warmup-steps", "0",
            "--value-pretrain-steps", "1", "--mini-batches", "1", "--max-summary-tokens", "64", "--save-every", "1",
            "--keep-checkpoints", "1", "--no-export-hf", "--lr-schedule", "constant"] + FLAGS[cfg.tiny]
    out, t_run = train_py(args + ["--steps", "3"])
    out2, t_resume = train_py(args + ["--steps", "4", "--resume"])
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]

    gpu = torch.cuda.is_available()
    c = tyro.cli(train.Config, args=args + ["--steps", "3"])
    setup = train.memory_setup(c, 1, gpu)
    shapes = memory_plan.model_shapes(hf_config(model))
    bound = memory_plan.peaks(memory_plan.plan(shapes, setup)[0], setup)
    device = torch.cuda.get_device_name() if gpu else "CPU"
    print(f"{device}, torch {torch.__version__}; {shapes.params / 1e6:.0f}M-parameter Qwen3-shaped model, "
          f"window {max_model_len(c.rollout)} tokens, bf16 {'on' if setup.mixed_precision else 'off'}, "
          f"activation checkpointing on; 3 steps in {t_run:.0f} s, the resumed step in {t_resume:.0f} s")
    print(f"{'step':<5}{'phase':<9}{'measured':>10}{'planned':>10}{'ratio':>7}{'bound':>10}   (GiB; planned at the "
          f"step's sizes, bound for the flags; " + ("allocator peaks, runtime excluded)" if gpu else
                                                    "resident set, not checked on a CPU)"))
    within = True
    for r in recs:
        for p, (measured, planned) in memory_plan.metered(shapes, setup, r).items():
            limit = bound[p] - (memory_plan.RUNTIME_GPU if gpu else 0)
            within &= measured <= limit or not gpu
            print(f"{r['step']:<5}{p:<9}{measured / 2**30:10.2f}{planned / 2**30:10.2f}{measured / planned:7.2f}"
                  f"{limit / 2**30:10.2f}")
    for r in recs:
        passes = c.optim.critic_updates + (c.optim.ppo_epochs if "time/actor" in r else 0)
        seconds = r.get("time/critic", 0) + r.get("time/actor", 0)
        print(f"step {r['step']}: update {r['batch/tokens'] * passes / seconds:,.0f} tokens/s ({r['batch/tokens']:.0f} "
              f"window tokens × {passes} passes in {seconds:.1f} s); longest window {r['batch/longest_window']:.0f}; "
              f"sampler-vs-trainer log-prob diff {r['policy/sampler_logprob_diff']:.2e}; rollout {r['time/rollout']:.1f} s")
    resumed = "resumed from" in out2 and [r["step"] for r in recs] == [0, 1, 2, 3]
    print(f"resume from the DCP checkpoint: {'yes' if resumed else 'NO'} "
          f"({next((line for line in out2.splitlines() if 'resumed from' in line), 'no resume line')})")
    print(f"peaks within the plan's bound: {'yes' if within else 'NO'}; total {time.time() - t_start:.0f} s")
    return 0 if resumed and within else 1


if __name__ == "__main__":
    import tyro
    sys.exit(main(tyro.cli(Config)))
