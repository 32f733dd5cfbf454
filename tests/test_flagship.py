"""The README's at-scale command (Qwen3-8B, 8 GPUs, 64k context), checked on CPU with Qwen3-8B's
real config (tests/data/qwen3-8b/config.json) and a Qwen3-style template: it parses, trains past
value pre-training, fits the model's positions, and passes every start-up check train.py runs
before a model loads.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_flagship.py
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

import memory_plan
import train
from config import make, max_model_len, override, parse_config
from model import build_tiny_model, hf_config
from tests.chat_families import family_tokenizer
from tests.test_train import ROOT

QWEN3_8B = os.path.join(ROOT, "tests", "data", "qwen3-8b")


def readme_command():
    """The flags of the README's `torchrun ... train.py` command under "Running at scale"."""
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text[text.index("## Running at scale"):]
    command = re.search(r"torchrun --nnodes.*?train\.py(.*?)\n\n", block, re.S).group(1)
    return command.replace("\\\n", " ").split()


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory):
    """Qwen3-8B's config with a Qwen3-style tokenizer and template (the real tokenizer is a
    download): what train.py's start-up checks read."""
    d = str(tmp_path_factory.mktemp("qwen3-8b"))
    shutil.copy(os.path.join(QWEN3_8B, "config.json"), d)
    family_tokenizer("qwen3").save_pretrained(d)
    return d


def flagship(model):
    return parse_config(readme_command() + ["--model", model])


def test_the_readme_command_updates_the_policy_and_fits_qwen3s_positions(qwen3_8b):
    cfg = flagship(qwen3_8b)
    assert cfg.model.path == qwen3_8b and cfg.rollout.context_budget == 65536 and cfg.model.engine == "vllm"
    train.finalize(cfg, world=8)  # --steps past --value-pretrain-steps
    assert cfg.optim.steps > cfg.optim.value_pretrain_steps
    train.check_model(cfg, qwen3_8b)  # positions (with its --rope-scaling) and the chat template


def flagship_plan(cfg, model, **flags):
    """The memory plan of `cfg` on 8 ranks of 80 GiB GPUs: (Shapes, Setup, phases)."""
    cfg = override(cfg, device_memory_gib=80, **flags)
    setup = train.memory_setup(cfg, 8, gpu=True)
    shapes = memory_plan.model_shapes(hf_config(model, cfg.model.rope_scaling))
    return shapes, setup, memory_plan.plan(shapes, setup)[0]


def test_the_readme_command_fits_8_gpus_of_80_gib(qwen3_8b):
    cfg = flagship(qwen3_8b)
    shapes, setup, phases = flagship_plan(cfg, qwen3_8b)
    assert setup.window == 77824 and setup.mixed_precision and setup.engine == "vllm"
    assert memory_plan.fits(phases, setup)
    train.check_memory(override(cfg, device_memory_gib=80), qwen3_8b, setup)
    # what it needs: without CPU offload the update does not fit, and the plan says which flag fixes it
    _, bare, without = flagship_plan(cfg, qwen3_8b, cpu_offload=False)
    assert not memory_plan.fits(without, bare)
    assert memory_plan.remedies(shapes, bare, {"kv_cache_gib": cfg.model.kv_cache_gib}) == ["--cpu-offload"]
    with pytest.raises(MemoryError, match=r"DOES NOT FIT in .*actor(.|\n)*It fits with --cpu-offload"):
        train.check_memory(cfg, qwen3_8b, bare)


def test_vllm_is_sized_from_the_plan_not_from_free_memory(qwen3_8b):
    """vLLM checks at start that gpu_memory_utilization × the device is free, also when its KV
    cache is given in bytes. When it starts, the trainer already holds its sharded weights: the
    default 0.9 cannot be free, the plan's share is."""
    shapes, setup, _ = flagship_plan(flagship(qwen3_8b), qwen3_8b)
    total = setup.device_bytes
    held = (4 * shapes.params + 4 * shapes.critic_params) // 8 + memory_plan.RUNTIME_GPU
    fraction = memory_plan.engine_fraction(shapes, setup)
    assert fraction * total <= total - held < 0.9 * total
    engine_bytes = 2 * shapes.params + setup.kv_cache_bytes + memory_plan.VLLM_WORKSPACE_GPU
    assert fraction * total >= engine_bytes  # and it holds what the engine allocates


def test_the_longest_sequence_must_fit_the_models_positions(qwen3_8b):
    cfg = make(model=qwen3_8b, context_budget=65536, reserve=10240, max_action_tokens=10240,
               max_summary_tokens=10240)
    assert max_model_len(cfg.rollout) == 77824
    with pytest.raises(ValueError, match=r"77824 tokens .* past .*'s 40960 positions .*no rope scaling.*--rope-scaling"):
        train.check_model(cfg, qwen3_8b)
    train.check_model(override(cfg, rope_scaling=(4.0, 32768)), qwen3_8b)  # YaRN: 131072 positions
    with pytest.raises(ValueError, match=r"past .*'s 131072 positions \(max_position_embeddings, YaRN"):
        train.check_model(override(cfg, rope_scaling=(4.0, 32768), context_budget=130000), qwen3_8b)


def test_train_py_stops_before_any_model_when_a_check_fails(tmp_path):
    """Positions, the chat template and the memory plan are checked in prepare_run, on every rank,
    before a model loads: the run ends with the reason, not an out-of-range position, a template
    error or an out-of-memory error later."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}

    def train_py(model, out, *flags):
        return subprocess.run([sys.executable, "train.py", "--model", model, "--out-dir", str(tmp_path / out),
                               "--steps", "1", "--value-pretrain-steps", "0", *flags],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    p = train_py(build_tiny_model(str(tmp_path / "short"), train.tiny_corpus(), max_positions=1024), "a")
    assert p.returncode != 0 and "is past " in p.stderr and "1024 positions" in p.stderr, p.stderr[-2000:]
    assert "world 1 ·" not in p.stdout
    model = build_tiny_model(str(tmp_path / "plain"), train.tiny_corpus(), max_positions=8192)
    tok = family_tokenizer("qwen3")
    tok.chat_template = "{%- for m in messages -%}{{- m.role + ': ' + m.content + '\\n' -}}{%- endfor -%}"
    tok.save_pretrained(model)
    p = train_py(model, "b")
    assert p.returncode != 0 and "chat template" in p.stderr, p.stderr[-2000:]
    assert "world 1 ·" not in p.stdout
    p = train_py(build_tiny_model(str(tmp_path / "fits"), train.tiny_corpus(), max_positions=8192), "c", "--device-memory-gib", "0.1")
    assert p.returncode != 0 and "DOES NOT FIT" in p.stderr and "activations" in p.stderr, p.stderr[-2000:]
    assert "world 1 ·" not in p.stdout


def test_the_gpu_check_runs_its_path_on_a_tiny_model(tmp_path):
    """gpu_check.py --tiny: train.py for 3 steps and a resumed one, the report with every figure."""
    p = subprocess.run([sys.executable, "gpu_check.py", "--tiny", "--out-dir", str(tmp_path / "check")], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "resume from the DCP checkpoint: yes (resumed from" in p.stdout
    for phase in memory_plan.PHASES:
        assert f"2    {phase:<9}" in p.stdout, phase  # step 2 updates the policy: every phase measured
    assert re.search(r"step 2: update [\d,]+ tokens/s .* sampler-vs-trainer log-prob diff \d", p.stdout)
