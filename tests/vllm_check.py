"""Real-vLLM checks of vllm_engine.VLLMEngine on the tiny model, in a process of their own (an
in-process engine changes its host process: see vllm_engine's docstring). One engine start serves
every check; the measurements go to a JSON file that tests/test_vllm_engine.py asserts on.

    OMP_NUM_THREADS=1 python tests/vllm_check.py OUT.json WORK_DIR
"""
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdp  # noqa: E402
import memory_task  # noqa: E402
from config import RolloutConfig  # noqa: E402
from engine import HFEngine  # noqa: E402
from model import (Actor, ChatCodec, build_tiny_model, hf_config, load_policy, load_tokenizer,  # noqa: E402
                   rope_overrides)
from rollout import run_episodes  # noqa: E402
from train import tiny_corpus  # noqa: E402
from vllm_engine import VLLMEngine  # noqa: E402

T = 0.7  # sampling temperature ≠ 1: the log-probs must be those of softmax(logits / T)


def recompute(lm, prompts, gens, temperature):
    """The trainer's log-probs (model.Actor, float32) of every generated token: max |Δ| vs engine."""
    worst = 0.0
    with torch.no_grad():
        for p, g in zip(prompts, gens):
            ids = torch.tensor([p + g.token_ids])
            lp, _ = Actor(lm)(ids, None, temperature)  # (1, L - 1)
            mine = lp[0, len(p) - 1:]
            worst = max(worst, (mine - torch.tensor(g.logprobs)).abs().max().item())
    return worst


def prompts_of(codec, n, min_len, n_lines=10):
    """n chat prompts (ids, ending in the generation prompt) of different lengths >= min_len."""
    out = []
    for i in range(n):
        lines = [f"noise {chr(65 + (i * 7 + j) % 26)}" for j in range(n_lines + 3 * i)]
        msgs = [{"role": "system", "content": memory_task.SYSTEM},
                {"role": "user", "content": " ".join(lines)}]
        out.append(codec.prompt(msgs) + codec.gen_prompt)
    assert min(map(len, out)) >= min_len, [len(p) for p in out]
    return out


def describe(gens, max_new, stop_ids):
    return [{"n": len(g.token_ids), "max_new": m, "finish": g.finish_reason,
             "last_is_stop": bool(g.token_ids) and g.token_ids[-1] in stop_ids,
             "stop_inside": any(t in stop_ids for t in g.token_ids[:-1]),
             "n_logprobs": len(g.logprobs)} for g, m in zip(gens, max_new)]


def one_update(lm, prompts, gens):
    """One Adam step on a real loss: the NLL of the engine's own samples (an SFT step)."""
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    loss = 0.0
    for p, g in zip(prompts, gens):
        ids = torch.tensor([p + g.token_ids])
        lp, _ = Actor(lm)(ids, None, 1.0)
        loss = loss - lp[0, len(p) - 1:].sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def episodes_record(eps, stop_ids):
    """Everything an episode batch holds, and how each sampled turn ended (stop token or cap)."""
    return [{"end": e.end_reason, "turns": e.turns, "compactions": e.compactions, "reward": e.reward,
             "summaries": e.summaries,
             "segments": [{"prompt": s.prompt_ids, "response": s.response_ids, "mask": s.loss_mask,
                           "spans": s.spans} for s in e.segments],
             "stopped": [s.response_ids[b - 1] in stop_ids for s in e.segments for kind, a, b in s.spans
                         if kind in ("action", "summary")]}
            for e in eps]


def main(out_path, work):
    r = {}
    model_dir = build_tiny_model(os.path.join(work, "tiny"), tiny_corpus())
    tok = load_tokenizer(model_dir)
    codec = ChatCodec(tok)
    lm = load_policy(model_dir).eval()
    eos = codec.stop_ids[0]

    # Building the engine must leave the trainer's RNG where it was.
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    t0 = time.time()
    engine = VLLMEngine(model_dir, max_model_len=512, seed=7, kv_cache_bytes=64 << 20)
    r["startup_s"] = time.time() - t0
    r["rng_untouched"] = torch.equal(torch.rand(4), want)

    # (1) generation from token ids: per-prompt max_new_tokens, stop handling, log-probs at T ≠ 1
    prompts = prompts_of(codec, 4, min_len=32)
    max_new = [1, 5, 17, 40]
    gens = engine.generate(prompts, max_new, T, [eos])
    r["length_calls"] = describe(gens, max_new, {eos})
    r["length_logprob_diff"] = recompute(lm, prompts, gens, T)
    # Half the vocabulary as stop ids: every sequence stops within a few tokens (p ≈ 2^-32 that
    # one of them runs 32 tokens without a stop).
    stops = [eos] + list(range(3, len(tok), 2))
    gens_stop = engine.generate(prompts, [32] * 4, T, stops)
    r["stop_calls"] = describe(gens_stop, [32] * 4, set(stops))
    r["stop_logprob_diff"] = recompute(lm, prompts, gens_stop, T)

    # A batch whose prefill exceeds one step's token budget (4096 on CPU) is prefilled in chunks.
    big = prompts_of(codec, 4, min_len=32) * 40  # 160 prompts, ~8.2k prompt tokens
    gens_big = engine.generate(big, [3] * len(big), T, [eos])
    r["chunked_prefill_tokens"] = sum(map(len, big))
    r["chunked_lengths_ok"] = all(len(g.token_ids) == len(g.logprobs) and 1 <= len(g.token_ids) <= 3
                                  for g in gens_big)
    r["chunked_logprob_diff"] = recompute(lm, big, gens_big, T)

    # Sampling draws from torch's global generator: re-seeding it reproduces the samples.
    torch.manual_seed(11)
    a = engine.generate(prompts, [16] * 4, 1.0, [eos])
    torch.manual_seed(11)
    b = engine.generate(prompts, [16] * 4, 1.0, [eos])
    c = engine.generate(prompts, [16] * 4, 1.0, [eos])
    r["reseeded_equal"] = [g.token_ids for g in a] == [g.token_ids for g in b]
    r["next_draw_differs"] = [g.token_ids for g in a] != [g.token_ids for g in c]

    # Continuous batching: requests join a running batch; an aborted one never comes back.
    engine.submit("a", prompts[0], 30, T, [eos])
    engine.step()
    engine.submit("b", prompts[1], 4, T, [eos])
    engine.submit("c", prompts[2], 30, T, [eos])
    engine.abort(["c"])
    order = []
    for _ in range(100):
        order += [key for key, _ in engine.step()]
    r["continuous_order"] = order  # b (4 tokens) finishes first though it came in later
    r["capacity_64"] = engine.capacity(64)  # 64 MiB of KV cache, 64-token windows

    # (2) weight pushes. An empty push is refused (vLLM would reload the checkpoint from disk).
    for name, empty in (("list", []), ("generator", iter(()))):
        try:
            engine.load_weights(empty)
            r[f"empty_{name}"] = "accepted"
        except ValueError as e:
            r[f"empty_{name}"] = str(e)
    # Push 1, in train.py's order: rollout, sleep, update, push (while asleep), wake up, rollout.
    long_prompts = prompts_of(codec, 4, min_len=64, n_lines=30)  # >= 2 KV blocks of 32 tokens
    engine.generate(long_prompts, [8] * 4, T, [eos])  # fills the prefix cache with old-weight KV
    engine.sleep()
    one_update(lm, prompts, gens)
    try:
        engine.generate(prompts, [4] * 4, T, [eos])
        r["generate_asleep"] = "accepted"
    except RuntimeError as e:
        r["generate_asleep"] = str(e)
    engine.load_weights((k, v) for k, v in lm.state_dict().items())  # a generator streams
    engine.wake_up()
    g1 = engine.generate(long_prompts, [16] * 4, T, [eos])
    r["push1_diff"] = recompute(lm, long_prompts, g1, T)
    # Push 2, awake, after the same long prompts were cached with the old weights: a stale engine
    # differs from the updated model; after the push it equals it (prefix cache reset included).
    one_update(lm, prompts, gens)
    g_stale = engine.generate(long_prompts, [16] * 4, T, [eos])
    r["stale_diff"] = recompute(lm, long_prompts, g_stale, T)
    t0 = time.time()
    engine.load_weights(list(lm.state_dict().items()))
    r["push_s"] = time.time() - t0
    g2 = engine.generate(long_prompts, [16] * 4, T, [eos])
    r["push2_diff"] = recompute(lm, long_prompts, g2, T)

    # (4) one episode batch through both engines, sampling greedily for all practical purposes:
    # the final norm's weight ×1000 multiplies the logits by 1000 (vLLM clamps T to >= 0.01, so a
    # tiny T cannot do it), and at T = 0.01 the top-2 gaps of the random model (~0.2 before the
    # scaling) become ~2e4 nats. Both engines then take the argmax and the agent loop must build
    # the same batch token for token: windows, spans, masks, compactions, summaries, rewards.
    # Twice: stopping on eos only, which the random model's argmax never picks (every turn runs to
    # its length cap: per-prompt max_new_tokens), and on every id (every turn is one stop token:
    # the stop is kept and the turn closed accordingly).
    with torch.no_grad():
        lm.get_decoder().norm.weight.mul_(1000.0)
    engine.load_weights(list(lm.state_dict().items()))
    cfg = RolloutConfig(context_budget=72, reserve=16, max_compactions=3, max_turns=30, max_action_tokens=4,
                        max_summary_tokens=6, summary_instruction=memory_task.SUMMARY_INSTRUCTION,
                        resume_template=memory_task.RESUME, temperature=0.01)
    rows = memory_task.make_tasks(6, seed=3, n_noise=6, p_short=0.3)
    r["episodes"] = {}
    for stops_name, stops in (("eos", [eos]), ("every_id", list(range(len(tok))))):
        codec.stop_ids = stops
        for name, eng in (("hf", HFEngine(lm, tok.pad_token_id)), ("vllm", engine)):
            envs = [memory_task.MemoryEnv(row) for row in rows]
            eps = run_episodes(eng, codec, envs, cfg, list(range(len(rows))), [row["task_id"] for row in rows])
            r["episodes"][f"{stops_name}/{name}"] = episodes_record(eps, set(stops))
    # (5) long context: YaRN rope scaling, handed to the trainer's config and to vLLM alike. A tiny
    # model made for 64 positions, extended 4x (model.rope_overrides); its sequences run past 64.
    from transformers import AutoConfig
    short = build_tiny_model(os.path.join(work, "tiny64"), tiny_corpus(), max_positions=64)
    scaling = (4.0, 64)
    fsdp.init_distributed()  # the environment train.py gives a second engine (rank variables)
    yarn_engine = VLLMEngine(short, max_model_len=256, seed=7, kv_cache_bytes=32 << 20,
                             hf_overrides=rope_overrides(AutoConfig.from_pretrained(short), scaling),
                             memory_fraction=0.125)  # the memory plan's share reaches vLLM's config
    r["memory_fraction"] = yarn_engine.llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization
    long_prompts = prompts_of(codec, 3, min_len=150, n_lines=60)
    g_long = yarn_engine.generate(long_prompts, [24] * 3, T, [eos])
    r["yarn_longest"] = max(len(p) + len(g.token_ids) for p, g in zip(long_prompts, g_long))
    r["yarn_logprob_diff"] = recompute(load_policy(short, config=hf_config(short, scaling)).eval(), long_prompts,
                                       g_long, T)
    r["yarn_vs_plain_rope_diff"] = recompute(load_policy(short).eval(), long_prompts, g_long, T)
    with open(out_path, "w") as f:
        json.dump(r, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
