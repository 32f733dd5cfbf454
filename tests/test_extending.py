"""docs/extending.md runs: its example task goes through the agent loop with a scripted engine
(right answer 1, wrong 0, no number: format errors), its estimator matches a loop, its engine
samples the tiny model with the log-probs the trainer computes, and its links lead somewhere.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_extending.py
"""
import os
import re

import pytest
import torch

from config import RolloutConfig
from engine import Generation
from model import ChatCodec, build_tiny_model, load_policy, load_tokenizer, token_logprobs
from rollout import run_episodes
from test_docs import ROOT, defined_names
from train import tiny_corpus

DOC = os.path.join(ROOT, "docs", "extending.md")
BLOCK = re.compile(r"```python\n(# docs/extending\.md: example (\w+)\n.*?)```", re.S)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def doc_text():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def example(name):
    """The namespace of the doc's code block marked `# docs/extending.md: example <name>`."""
    blocks = [code for code, tag in BLOCK.findall(doc_text()) if tag == name]
    assert len(blocks) == 1, f"docs/extending.md: expected one block marked 'example {name}', found {len(blocks)}"
    namespace = {"__name__": f"extending_example_{name}"}
    exec(compile(blocks[0], f"docs/extending.md (example {name})", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_model(d, tiny_corpus())
    tok = load_tokenizer(d)
    return tok, ChatCodec(tok), d


class ScriptedEngine:
    """Replies with `reply(decoded prompt)`, then the stop token."""

    def __init__(self, tok, reply):
        self.tok, self.reply = tok, reply

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        out = []
        for p, n in zip(prompts, max_new_tokens):
            ids = (self.tok.encode(self.reply(self.tok.decode(p)), add_special_tokens=False) + [stop_token_ids[0]])[:n]
            out.append(Generation(ids, [-0.5] * len(ids), "stop"))
        return out


def config():
    return RolloutConfig(context_budget=256, reserve=16, max_compactions=1, max_turns=5, max_action_tokens=8,
                         max_summary_tokens=8)


def sum_in(text):
    a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
    return int(a) + int(b)


@pytest.mark.parametrize("reply,reward,end", [
    (lambda text: str(sum_in(text)), 1.0, "submitted"),
    (lambda text: str(sum_in(text) + 1), 0.0, "submitted"),
    (lambda text: "no idea", 0.0, "format_errors"),
], ids=["right", "wrong", "no-number"])
def test_example_task_through_the_agent_loop(tiny, reply, reward, end):
    tok, codec, _ = tiny
    task = example("task")
    rows = task["make_tasks"](3, seed=0)
    envs = [task["AdditionEnv"](r) for r in rows]
    eps = run_episodes(ScriptedEngine(tok, reply), codec, envs, config(), [0, 1, 2], [r["task_id"] for r in rows])
    assert [(e.end_reason, e.reward) for e in eps] == [(end, reward)] * 3
    if end == "format_errors":
        assert all(e.turns == config().max_format_errors for e in eps)


def test_example_estimator_is_r_minus_v_per_token():
    mc = example("estimator")["monte_carlo_advantage"]
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 7, generator=g) > 0.3).double()
    values, rewards = torch.rand(4, 7, generator=g, dtype=torch.float64), torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv, ret = mc(values * mask, mask, rewards.double())
    for b in range(4):
        for t in range(7):
            want = rewards[b] - values[b, t] if mask[b, t] else 0.0
            assert abs(float(adv[b, t]) - float(want)) < 1e-12
            assert float(ret[b, t]) == (float(rewards[b]) if mask[b, t] else 0.0)


def test_example_engine_samples_with_the_trainers_logprobs(tiny):
    tok, codec, d = tiny
    model = load_policy(d)
    engine = example("engine")["NaiveEngine"](model)
    prompt = codec.prompt(example("task")["AdditionEnv"]({"a": 2, "b": 3}).reset()) + codec.gen_prompt
    first, again = (engine.generate([prompt, prompt], [5, 3], 1.0, codec.stop_ids, seeds=[7, 8]) for _ in range(2))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]  # a function of prompt and seed
    assert len(first[0].token_ids) <= 5 and len(first[1].token_ids) <= 3
    g = first[0]
    ids = torch.tensor([prompt + g.token_ids])
    with torch.no_grad():
        want, _ = token_logprobs(model, ids, ids[:, 1:])
    assert torch.allclose(torch.tensor(g.logprobs), want[0, len(prompt) - 1:], atol=1e-4)


@pytest.mark.parametrize("label,target", LINK.findall(doc_text()), ids=lambda x: x[:60])
def test_link_resolves(label, target):
    """A relative link names a file that exists, and `file.py#name` a name it defines."""
    path, _, fragment = target.partition("#")
    full = os.path.normpath(os.path.join(os.path.dirname(DOC), path))
    assert full.startswith(ROOT + os.sep) and os.path.exists(full), f"{target}: no such file"
    if fragment and full.endswith(".py"):
        assert fragment in defined_names(full), f"{target}: {fragment} is not defined in {path}"


def test_registration_lines_match_the_code():
    """The lines the doc says to change are still the code's (so the edits it shows apply)."""
    with open(os.path.join(ROOT, "config.py"), encoding="utf-8") as f:
        config_py = f.read()
    with open(os.path.join(ROOT, "train.py"), encoding="utf-8") as f:
        train_py = f.read()
    with open(os.path.join(ROOT, "loss.py"), encoding="utf-8") as f:
        loss_py = f.read()
    assert 'name: Annotated[Literal["memory", "swe"], tyro.conf.arg(name="task")] = "memory"' in config_py
    assert 'preset: Literal["memory", "swe", "swe-paper"] = "memory"' in config_py and "PRESETS = {\n" in config_py
    assert '    if cfg.task.name == "memory":\n' in train_py and "make = memory_task.MemoryEnv" in train_py
    assert '    elif estimator == "per-segment":\n' in train_py
    assert 'NORMALIZERS = ("token", "segment", "rollout")' in loss_py
    assert 'engine: Literal["auto", "hf", "vllm"]' in config_py
