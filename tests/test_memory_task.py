"""memory_task.py: the episode layout, the reward, and what the warm-up demos do and do not teach.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_memory_task.py
"""
import pytest

import memory_task
from config import RolloutConfig
from model import ChatCodec, build_tiny_model, load_tokenizer
from rollout import run_episodes
from train import tiny_corpus


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_model(d, tiny_corpus())
    return ChatCodec(load_tokenizer(d))


def test_rows_place_the_key_among_the_distractors():
    rows = memory_task.make_tasks(300, seed=0, n_keys=4, n_noise=6, p_short=0.5, max_noise_short=2)
    short = [r for r in rows if len(r["noise"]) <= 2]
    assert 100 < len(short) < 200 and all(len(r["noise"]) in (0, 1, 2, 6) for r in rows)
    assert all(r["key"] in "ABCD" and 0 <= r["key_at"] <= min(2, len(r["noise"])) for r in rows)
    assert len({r["key_at"] for r in rows}) == 3  # the key's position varies


def test_env_observations_and_reward():
    env = memory_task.MemoryEnv({"task_id": "t", "key": "C", "noise": ["A", "B", "D"], "key_at": 1})
    assert env.reset()[0]["role"] == "system"
    obs = [env.step("ok").observation for _ in range(5)]
    assert obs == ["noise A", "key C", "noise B", "noise D", "answer?"]
    step = env.step(" C is the key")
    assert step.done and env.reward() == 1.0
    env.reset()
    for _ in range(5):
        env.step("ok")
    env.step("A")
    assert env.reward() == 0.0


def test_warmup_demos_copy_a_random_line_into_summaries_and_answer_from_context(codec):
    rows = memory_task.make_tasks(120, seed=1, n_keys=4, n_noise=6, p_short=0.5)
    cfg = RolloutConfig(context_budget=72, reserve=16, max_compactions=3, max_turns=20,
                        max_action_tokens=4, max_summary_tokens=6,
                        summary_instruction=memory_task.SUMMARY_INSTRUCTION, resume_template=memory_task.RESUME)
    demo = memory_task.WarmupDemoEngine(codec, n_keys=4, seed=0)
    eps = run_episodes(demo, codec, [memory_task.MemoryEnv(r) for r in rows], cfg,
                       list(range(len(rows))), [r["task_id"] for r in rows])
    short = [e for e in eps if e.compactions == 0]
    long = [(e, r) for e, r in zip(eps, rows) if e.compactions > 0]
    assert short and long and all(e.end_reason == "submitted" for e in eps)
    assert all(e.reward == 1.0 for e in short)  # the key is in context: answered
    for e, r in long:  # a summary is one observation line, the answer repeats its symbol
        assert e.summaries[-1] in {f"noise {x}" for x in r["noise"]} | {f"key {r['key']}"}
        last_action = e.segments[-1].response_ids[e.segments[-1].spans[-1][1]:]
        assert codec.decode(last_action) == e.summaries[-1][-1]
    # which line is kept is random: the key line rarely, and then only by chance
    key_lines = sum(e.summaries[-1].startswith("key") for e, _ in long)
    assert 0 < key_lines < 0.35 * len(long)
    hits = sum(e.summaries[-1][-1] == r["key"] for e, r in long)
    assert hits < 0.6 * len(long)
