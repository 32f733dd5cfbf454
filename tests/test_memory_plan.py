"""memory_plan.py: the model's shapes from its config on the meta device, the activations a decoder
layer keeps against what autograd really saves, the plan's phases, and the meter that measures
them in a run. (Measured peaks of whole train.py runs against the plan: bench_memory.py.)

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_memory_plan.py
"""
import os
from dataclasses import replace

import pytest
import torch

import memory_plan
from model import hf_config
from tests.test_train import ROOT

QWEN3_8B = os.path.join(ROOT, "tests", "data", "qwen3-8b")


def test_shapes_of_qwen3_8b_from_its_config():
    s = memory_plan.model_shapes(hf_config(QWEN3_8B))
    assert s.params == 8_190_735_360 and s.layers == 36
    assert s.critic_params == s.params - 151936 * 4096 + 4096 + 1  # no LM head (untied), a value head
    assert s.largest == 151936 * 4096  # the embedding (and the head)
    assert (s.hidden, s.intermediate, s.q_dim, s.kv_dim) == (4096, 12288, 4096, 1024)
    assert s.activation_bytes_per_token(2) == 2 * (8 * 4096 + 6 * 4096 + 6 * 1024 + 4 * 12288)  # 220 KiB
    assert s.kv_bytes_per_token(2) == 2 * 36 * 1024 * 2


def saved_bytes_per_token(hidden, intermediate, heads, kv_heads, dtype, tokens=256):
    """What autograd saves in one Qwen3 decoder layer's forward, per token (saved_tensors_hooks,
    each storage once, the layer's weights left out)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=64, num_hidden_layers=1, vocab_size=64)
    lm = Qwen3ForCausalLM(cfg).to(dtype).train()
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(1, tokens, hidden, dtype=dtype, requires_grad=True)
    position_embeddings = lm.model.rotary_emb(x, torch.arange(tokens)[None])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm.model.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
    return sum(saved.values()) / tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden,intermediate,heads,kv_heads", [(256, 1024, 4, 2), (384, 1536, 6, 6)])
def test_activations_per_token_are_what_autograd_saves(hidden, intermediate, heads, kv_heads, dtype):
    shapes = memory_plan.Shapes(params=0, critic_params=0, layers=1, layer_params=0, largest=0, hidden=hidden,
                                intermediate=intermediate, q_dim=heads * 64, kv_dim=kv_heads * 64, vocab=64)
    b = torch.finfo(dtype).bits // 8
    measured = saved_bytes_per_token(hidden, intermediate, heads, kv_heads, dtype)
    assert measured <= shapes.activation_bytes_per_token(b) <= 1.06 * measured  # never under, at most 6% over


def setup(**kw):
    base = dict(world=8, gpu=True, device_bytes=80 * 2**30, mixed_precision=True, engine="vllm", window=77824,
                longest=77824, episodes=16, kv_cache_bytes=20 * 2**30, max_new_tokens=10240,
                activation_checkpointing=True, cpu_offload=True)
    return memory_plan.Setup(**{**base, **kw})


def test_phases_hold_what_each_phase_holds():
    shapes = memory_plan.model_shapes(hf_config(QWEN3_8B, (4.0, 32768)))
    phases, host = memory_plan.plan(shapes, setup(cpu_offload=False))
    assert host == 0
    # vLLM sleeps outside the rollout; a push wakes only its weights; gradients only in their update
    assert "engine KV cache" in phases["rollout"] and "engine KV cache" not in phases["sync"]
    assert "engine weights" in phases["sync"] and "engine weights" not in phases["actor"]
    assert "actor fp32 gradients" in phases["actor"] and "actor fp32 gradients" not in phases["critic"]
    assert phases["rollout"]["Adam moments"] == 8 * (shapes.params + shapes.critic_params) // 8
    offloaded, host = memory_plan.plan(shapes, setup())
    assert "Adam moments" not in offloaded["actor"] and host > 0
    # activation checkpointing keeps a layer's input instead of all it saves: 36 layers of 77824 tokens
    plain = memory_plan.plan(shapes, setup(activation_checkpointing=False))[0]
    assert plain["actor"]["activations"] > 36 * 77824 * 220 * 2**10 > 10 * phases["actor"]["activations"]
    assert memory_plan.remedies(shapes, setup(activation_checkpointing=False, cpu_offload=False),
                                {"kv_cache_gib": 20}) == ["--activation-checkpointing --cpu-offload"]


def test_the_head_keeps_its_log_softmax_only_where_the_plan_fits_with_it(tmp_path):
    """choose_head: the saved log-softmax costs T·V float32 in the update; at the paper's 77824-token
    micro-batches and Qwen3-8B's 151936 tokens (44 GiB) it does not fit an 80 GiB GPU beside the
    rest, so the head recomputes its chunks; the tiny default's fits."""
    from model import build_tiny_model
    from train import tiny_corpus
    big = memory_plan.model_shapes(hf_config(QWEN3_8B, (4.0, 32768)))
    s = setup(cpu_offload=False)
    recompute, saved = (memory_plan.plan(big, replace(s, save_head=flag))[0] for flag in (False, True))
    assert saved["actor"]["log-prob head"] - recompute["actor"]["log-prob head"] == s.window * big.vocab * 4
    assert not memory_plan.choose_head(big, s).save_head
    tiny = memory_plan.model_shapes(hf_config(build_tiny_model(str(tmp_path), tiny_corpus(), vocab_size=300)))
    assert memory_plan.choose_head(tiny, replace(s, window=16384)).save_head


def test_the_meter_measures_a_phase_peak_on_cpu():
    meter = memory_plan.PeakMeter()
    with meter.phase("big"):
        x = torch.ones(32 * 2**20)  # 128 MiB, touched
        del x
    with meter.phase("small"):
        y = torch.ones(2**20)
        del y
    peak = meter.take()
    assert peak["big"] - peak["small"] >= 120 * 2**20 and meter.take() == {}
