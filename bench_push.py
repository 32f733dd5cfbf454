"""Peak extra memory of a weight push (train.push_weights: FSDP2 shards gathered one tensor at a
time, in the engine's dtype) against the model's full float32 size, on CPU, beside the whole-model
gather it replaced (every tensor gathered in float32 first, as one list, then loaded).

    MALLOC_MMAP_THRESHOLD_=65536 OMP_NUM_THREADS=1 torchrun --nproc_per_node=2 bench_push.py
    ... bench_push.py --engine-dtype bfloat16        # an engine in bf16, as on GPUs

Each rank holds its FSDP2 shards of a randomly initialized ~100M-parameter Qwen3-shaped model and an
HFEngine with its own copy. A push's extra memory is the rise of the resident set's high-water mark
over the resident set before the push (memory_plan.resident_bytes; with the glibc setting above every
tensor of 64 KiB or more is mapped on its own and returned when freed). Prints, per rank, the extra
bytes of each push and ratio = extra ÷ the full float32 model (goal <= 0.1), and the bound the
memory plan uses for the streamed push: the largest tensor, in the engine's dtype, plus its shard,
plus the full buffer gloo gathers through (NCCL gathers in place).
"""
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fsdp
import memory_plan
import train
from engine import HFEngine


@dataclass
class Config:
    hidden: int = 768
    """Hidden size of the Qwen3-shaped model (12 layers, 12 heads of 64, 4 KV heads, MLP 2048)."""
    vocab: int = 32000
    """Vocabulary: the embedding (tied to the head) is the largest tensor, 25% of the parameters."""
    engine_dtype: str = "float32"
    """The engine's dtype; the push casts each shard to it before the gather."""
    repeats: int = 3
    """Pushes of each kind; the largest extra is reported."""


def extra_bytes(push):
    """The rise of the resident high-water mark over the resident set while push() runs."""
    memory_plan.reset_resident_peak()
    before = memory_plan.resident_bytes()
    push()
    return memory_plan.resident_bytes(peak=True) - before


def main(cfg):
    rank, world, device = fsdp.init_distributed()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        raise SystemExit("run with MALLOC_MMAP_THRESHOLD_=65536 (see the docstring)")
    from transformers import AutoModelForCausalLM, Qwen3Config
    hf = Qwen3Config(hidden_size=cfg.hidden, num_hidden_layers=12, num_attention_heads=12, head_dim=64,
                     num_key_value_heads=4, intermediate_size=2048, vocab_size=cfg.vocab, tie_word_embeddings=True)
    torch.manual_seed(0)

    def build(meta):
        return AutoModelForCausalLM.from_config(hf)
    actor = fsdp.load_sharded(build, device, mixed_precision=False)
    engine = HFEngine(AutoModelForCausalLM.from_config(hf).to(getattr(torch, cfg.engine_dtype)), pad_token_id=0)
    full = sum(p.numel() for p in actor.parameters()) * 4
    largest = max(t.numel() for t in actor.state_dict().values())

    def whole():  # what train.push_weights replaced
        sd = fsdp.full_state_dict(actor)
        engine.load_weights([(k, v) for k, v in sd.items()])

    streamed = max(extra_bytes(lambda: train.push_weights(actor, engine, device)) for _ in range(cfg.repeats))
    gathered = max(extra_bytes(whole) for _ in range(cfg.repeats))
    cast = 1 / world if engine.dtype != torch.float32 else 0  # the shard cast to the engine's dtype
    bound = largest * engine.dtype.itemsize * (1 + cast + 1)  # and gloo's own buffer: memory_plan
    rows = [None] * world
    dist.all_gather_object(rows, (rank, streamed, gathered))
    if rank == 0:
        print(f"{full / 4 / 1e6:.1f}M parameters ({full / 2**20:.0f} MiB in float32), {world} ranks, engine "
              f"{cfg.engine_dtype}; largest tensor {largest / 1e6:.1f}M elements; plan's bound for a streamed push "
              f"{bound / 2**20:.1f} MiB = {bound / full:.3f} of the model")
        for r, s, g in rows:
            print(f"rank {r}: streamed push {s / 2**20:7.1f} MiB, ratio {s / full:.3f} | whole-model gather "
                  f"{g / 2**20:7.1f} MiB, ratio {g / full:.3f}")
    fsdp.close_distributed()


if __name__ == "__main__":
    import tyro
    main(tyro.cli(Config))
