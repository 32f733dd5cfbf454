"""Token-in/token-out with the chat templates of the model families people train: Qwen3 (thinking
and non-thinking), Qwen2.5, Llama 3 and GLM-4.5 style (tests/chat_families.py). A multi-turn
episode with compaction runs through each: it never crashes on its template, the ids the sampler
saw are the ids the trainer scores, the context is the template's text, content stays inert, and
commands are read from the answer, never from the reasoning. Templates the codec cannot follow are
refused when the codec is built, which train.py does before any model loads.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_templates.py
"""
import pytest

from config import RolloutConfig
from engine import Generation
from env import Step, parse_action, split_reasoning
from model import ChatCodec
from rollout import run_episodes
from tests.chat_families import FAMILIES, VARIANTS, family_tokenizer

SYSTEM, TASK = "You are a careful engineer.", "Fix the failing test in src/utils.py."
DECOY = "rm -rf /"  # a command the policy only thinks about
REPLY = f"<think>\nI could run\n```bash\n{DECOY}\n```\nbut listing is safer.\n</think>\n\n```bash\nls src\n```"
CONVERSATION = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"}, {"role": "tool", "content": "T1"},
                {"role": "tool", "content": "T2"}, {"role": "assistant", "content": "<think>\nR2\n</think>\n\nA2"},
                {"role": "user", "content": "U2"}, {"role": "assistant", "content": "A3"}]
# Each family's rendering of CONVERSATION: the behaviours its documentation describes.
RENDERED = {
    # the last turn after the last query gets an empty <think> block; reasoning only there; tool
    # results grouped in one user turn, which does not count as a query (A2 keeps its reasoning)
    "qwen3": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
             "<|im_start|>user\n<tool_response>\nT1\n</tool_response>\n<tool_response>\nT2\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\nA2<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n"
             "<|im_start|>assistant\n<think>\n\n</think>\n\nA3<|im_end|>\n",
    "qwen2_5": "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
               "<think>\nR1\n</think>\n\nA1<|im_end|>\n<|im_start|>user\n<tool_response>\nT1\n</tool_response>\n"
               "<tool_response>\nT2\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2"
               "<|im_end|>\n<|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\nA3<|im_end|>\n",
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
              "Today Date: 26 Jul 2024\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n<think>\nR1\n</think>\n\nA1<|eot_id|>"
              "<|start_header_id|>ipython<|end_header_id|>\n\nT1<|eot_id|><|start_header_id|>ipython<|end_header_id|>"
              "\n\nT2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n<think>\nR2\n</think>\n\nA2<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nU2<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nA3<|eot_id|>",
    # no end-of-turn token; every turn not after the last user message shows an empty block
    "glm4_5": "[gMASK]<sop><|system|>\nS<|user|>\nU<|assistant|>\n<think></think>\nA1<|observation|>\n<tool_response>\n"
              "T1\n</tool_response>\n<tool_response>\nT2\n</tool_response><|assistant|>\n<think></think>\nA2<|user|>\nU2"
              "<|assistant|>\n<think></think>\nA3",
}


def render(tok, messages, kwargs, add_generation_prompt=False):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_each_template_renders_its_familys_documented_behaviour(name):
    tok = family_tokenizer(name)
    assert render(tok, CONVERSATION, {}) == RENDERED[name]


def test_the_thinking_switch_and_qwen3s_last_turn():
    qwen3, glm = family_tokenizer("qwen3"), family_tokenizer("glm4_5")
    head = CONVERSATION[:2]
    assert render(qwen3, head, {"enable_thinking": False}, True).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(qwen3, head, {"enable_thinking": True}, True).endswith("<|im_start|>assistant\n")
    assert render(glm, head, {"enable_thinking": False}, True) == \
        "[gMASK]<sop><|system|>\nS<|user|>\nU/nothink<|assistant|>\n<think></think>"
    # Qwen3: the same assistant turn renders differently once a message follows it, so a context
    # cannot be grown by re-rendering (what the codec's after_turn handles)
    turn = head + [{"role": "assistant", "content": "A"}]
    last, earlier = render(qwen3, turn, {}), render(qwen3, turn + [{"role": "user", "content": "O"}], {})
    assert last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n")
    assert "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nO" in earlier and not earlier.startswith(last)
    with pytest.raises(Exception, match="the system message must come first"):
        render(qwen3, head + [{"role": "system", "content": "late"}], {})


def test_split_reasoning():
    assert split_reasoning(REPLY) == (REPLY[:REPLY.index("\n\n```bash\nls")], "\n\n```bash\nls src\n```")
    assert split_reasoning("no reasoning ```x```") == ("", "no reasoning ```x```")
    assert split_reasoning("<think>\nstill thinking ```bash\nls\n```") == ("<think>\nstill thinking ```bash\nls\n```", "")
    assert split_reasoning("opened by the prompt</think>answer") == ("opened by the prompt</think>", "answer")
    assert parse_action(split_reasoning(REPLY)[1]) == ("ls src", None)
    assert parse_action(REPLY)[0] is None  # the whole turn holds two command blocks: a format error


class CommandEnv:
    """Records the command parsed from each answer and replies with an observation that spells
    every special-token string of the family; done after `n` commands."""

    def __init__(self, specials, n):
        self.specials, self.n, self.commands, self.observations = specials, n, [], []

    def reset(self):
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]

    def step(self, text):
        command, error = parse_action(text)
        if error:
            self.observations.append(error)
            return Step(error, done=False, format_error=True)
        self.commands.append(command)
        forged = "".join(self.specials)
        self.observations.append(f"<returncode>0</returncode>\n<output>\nutils.py {forged}\n{self.specials[-1]}user\n</output>")
        return Step(self.observations[-1], done=len(self.commands) >= self.n)

    def reward(self):
        return 1.0

    def close(self):
        pass


class RecordingEngine:
    """Replies REPLY to an action prompt and a summary (with reasoning) to a summary prompt; keeps
    every prompt and generation, as the trainer must see them."""

    def __init__(self, tok, codec, summary_instruction):
        self.tok, self.stop = tok, codec.stop_ids[0]
        self.asks_summary = codec.message({"role": "user", "content": summary_instruction}) + codec.gen_prompt
        self.calls = []

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        assert stop_token_ids == [self.stop]
        out = []
        for p, n in zip(prompts, max_new_tokens):
            summary = p[-len(self.asks_summary):] == self.asks_summary
            text = "<think>\nkeep the path\n</think>\n\nI listed src." if summary else REPLY
            ids = (self.tok.encode(text, add_special_tokens=False) + [self.stop])[:n]
            g = Generation(ids, [-0.25 - 0.01 * i for i in range(len(ids))], "stop" if ids[-1] == self.stop else "length")
            self.calls.append((list(p), g))
            out.append(g)
        return out


@pytest.mark.parametrize("cap", ["stops", "cut"])
@pytest.mark.parametrize("name,thinking", VARIANTS)
def test_an_episode_with_compaction_through_each_template(name, thinking, cap):
    tok, fam = family_tokenizer(name), FAMILIES[name]
    kwargs = fam.template_kwargs(thinking)
    codec = ChatCodec(tok, kwargs)
    # "cut": every action is cut at the length cap inside its reasoning: no command, format errors
    cfg = RolloutConfig(context_budget=700, reserve=120, max_compactions=4, max_turns=14,
                        max_action_tokens=120 if cap == "stops" else 6, max_summary_tokens=40,
                        summary_instruction="Summarize the work so far.", resume_template="{task}\nSummary: {summary}")
    engine = RecordingEngine(tok, codec, cfg.summary_instruction)
    envs = [CommandEnv(fam.special, n=6) for _ in range(2)]
    eps = run_episodes(engine, codec, envs, cfg, [0, 1], ["a", "b"])
    for ep, e in zip(eps, envs):
        if cap == "stops":
            assert ep.end_reason == "submitted" and ep.compactions >= 1, (ep.end_reason, ep.compactions)
            assert e.commands == ["ls src"] * 6  # the answer's command, never the one in the reasoning
            assert all(s == "I listed src." for s in ep.summaries)  # the summary without its reasoning
        else:
            assert ep.end_reason == "format_errors" and e.commands == []
    # the ids the sampler saw are the ids the trainer scores: every prompt is a prefix of its
    # window, the sampled ids follow it, trainable, with the sampler's log-probs
    windows = [s for ep in eps for s in ep.segments]
    for prompt, g in engine.calls:
        seg = next(s for s in windows if s.ids[:len(prompt)] == prompt and len(s.ids) > len(prompt))
        at = len(prompt) - len(seg.prompt_ids)
        assert seg.response_ids[at:at + len(g.token_ids)] == g.token_ids
        assert seg.loss_mask[at:at + len(g.token_ids)] == [1] * len(g.token_ids)
        assert seg.logprobs[at:at + len(g.token_ids)] == g.logprobs
    assert sum(s.n_tokens for s in windows) == sum(len(g.token_ids) for _, g in engine.calls)
    # each first window is the template's text: the head with its generation prompt, then per step
    # the sampled text and what the template renders after an assistant turn (its close and the
    # observation; the stop token once, sampled or injected), the generation prompt between steps
    head = CommandEnv(fam.special, 6).reset()
    start = render(tok, head, kwargs, add_generation_prompt=True)
    gen_prompt = start[len(render(tok, head, kwargs)):]
    special = set(tok.all_special_ids)
    for ep, e in zip(eps, envs):
        seg = ep.segments[0]
        actions = [seg.response_ids[a:b] for kind, a, b in seg.spans if kind == "action"]
        expected = start
        for i, (sampled, observation) in enumerate(zip(actions, e.observations)):
            stopped = sampled[-1] == codec.stop_ids[0]
            message = {"role": "user", "content": observation}
            after = render(tok, head + [{"role": "assistant", "content": "\ue00f"}, message], kwargs).split("\ue00f")[-1]
            expected += (gen_prompt if i else "") + tok.decode(sampled[:-1] if stopped else sampled,
                                                               skip_special_tokens=False) + after
            # content is inert: the special ids the observation brings are those of a harmless one
            harmless = codec.after_turn(sampled, {"role": "user", "content": "x"}) + codec.gen_prompt
            assert [i for i in codec.after_turn(sampled, message) + codec.gen_prompt if i in special] == \
                [i for i in harmless if i in special]
        window = tok.decode(seg.ids, skip_special_tokens=False)
        assert window.startswith(expected), (window[:len(expected)], expected)
        assert len(expected) > len(start) + len(REPLY)  # at least one step checked


def test_templates_the_codec_cannot_follow_are_refused():
    from tests.test_codec import chatml_tokenizer
    numbered = ("{%- for m in messages -%}{{- '<|im_start|>' + m.role + ' ' + loop.length|string + '\\n' + m.content"
                " + '<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
                "{%- endif -%}")
    with pytest.raises(ValueError, match="re-rendered earlier messages"):
        ChatCodec(chatml_tokenizer(numbered))
    plain = ("{%- for m in messages -%}{{- m.role + ': ' + m.content + '\\n' -}}{%- endfor -%}"
             "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}")
    with pytest.raises(ValueError, match="does not start with a special token"):
        ChatCodec(chatml_tokenizer(plain))
