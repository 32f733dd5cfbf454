"""model.py with the real tiny transformers model: save/load, chunked log-probs, engine/trainer
log-prob agreement, token-in/token-out chat rendering, the critic.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_model.py
"""
import pytest
import torch
import torch.nn.functional as F

from model import (Actor, ChatCodec, build_tiny_model, export_pretrained, load_critic, load_policy,
                   load_tokenizer, token_logprobs)
from rollout import HFEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_model(d)
    return d, load_tokenizer(d), load_policy(d)


def test_round_trip_save_load(tiny, tmp_path):
    d, tok, lm = tiny
    ids = torch.randint(3, len(tok), (2, 9))
    again = load_policy(d)
    torch.testing.assert_close(lm(ids).logits, again(ids).logits, rtol=0, atol=0)
    export_pretrained(lm, tok, str(tmp_path / "export"))
    exported = load_policy(str(tmp_path / "export"))
    torch.testing.assert_close(lm(ids).logits, exported(ids).logits, rtol=0, atol=0)
    assert load_tokenizer(str(tmp_path / "export")).encode("héllo ✓ key A") == tok.encode("héllo ✓ key A")


def test_tokenizer_special_tokens_and_round_trip(tiny):
    _, tok, _ = tiny
    for t in ("<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|end|>" and tok.pad_token == "<|endoftext|>"
    text = "naïve café ✓ 🙂\n```bash\nls\n```\tkey Q"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_all_roles(tiny):
    _, tok, _ = tiny
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "tool", "content": "T"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|system|>S<|end|><|user|>U<|end|><|assistant|>A<|end|><|tool|>T<|end|><|assistant|>"
    assert len(tok.encode(text, add_special_tokens=False)) == 13  # one token per role and per end


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_log_softmax(tiny, temperature):
    _, tok, lm = tiny
    torch.manual_seed(0)
    ids = torch.randint(3, len(tok), (3, 11))
    attn = torch.ones_like(ids)
    attn[2, 8:] = 0  # a right-padded row
    full = F.log_softmax(lm(ids, attention_mask=attn).logits[:, :-1].float() / temperature, -1)
    ref = full.gather(-1, ids[:, 1:, None])[..., 0]
    ref_ent = -(full.exp() * full).sum(-1)
    for chunk in (1, 3, 512):
        lp, ent = token_logprobs(lm, ids, attn, ids[:, 1:], temperature, chunk_size=chunk)
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    # with a mask the head runs only on the masked positions; the others are 0
    mask = torch.zeros(3, 10)
    mask[0, 2:5] = 1
    mask[2, 7] = 1
    lp, ent = token_logprobs(lm, ids, attn, ids[:, 1:], temperature, chunk_size=2, mask=mask)
    torch.testing.assert_close(lp, ref * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, atol=1e-5, rtol=1e-5)
    # gradients through the checkpointed chunks equal those of the plain computation
    lm.zero_grad()
    token_logprobs(lm, ids, attn, ids[:, 1:], temperature, chunk_size=3)[0].sum().backward()
    g_chunk = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    F.log_softmax(lm(ids, attention_mask=attn).logits[:, :-1].float() / temperature, -1) \
        .gather(-1, ids[:, 1:, None]).sum().backward()
    for a, p in zip(g_chunk, lm.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)
    lm.zero_grad()


def test_engine_logprobs_equal_trainer_logprobs(tiny):
    """Sampler log-probs (left-padded batched generate) = trainer recompute (right-padded)."""
    _, tok, lm = tiny
    torch.manual_seed(1)
    engine = HFEngine(lm, tok.pad_token_id)
    prompts = [tok.encode("key A", add_special_tokens=False), list(range(5, 25)), [7]]
    for temperature in (1.0, 0.6):
        gens = engine.generate(prompts, [6, 9, 4], temperature, [tok.eos_token_id])
        actor = Actor(lm, chunk_size=4)
        for p, g in zip(prompts, gens):
            assert 1 <= len(g.token_ids) <= 9
            ids = torch.tensor([p + g.token_ids])
            with torch.no_grad():
                lp, _ = actor(ids, torch.ones_like(ids), temperature)
            torch.testing.assert_close(lp[0, len(p) - 1:], torch.tensor(g.logprobs), atol=1e-4, rtol=0)


def test_engine_respects_per_prompt_limits_and_stop(tiny):
    _, tok, lm = tiny
    engine = HFEngine(lm, tok.pad_token_id)
    gens = engine.generate([[5, 6], [7, 8, 9]], [1, 3], 1.0, [tok.eos_token_id])
    assert len(gens[0].token_ids) == 1 and len(gens[1].token_ids) <= 3
    for g in gens:
        assert g.finish_reason == ("stop" if g.token_ids[-1] == tok.eos_token_id else "length")
        assert tok.eos_token_id not in g.token_ids[:-1]


def test_codec_incremental_ids_render_the_conversation(tiny):
    _, tok, _ = tiny
    codec = ChatCodec(tok)
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"}]
    action = tok.encode("ls", add_special_tokens=False) + [tok.eos_token_id]
    ids = codec.prompt(msgs) + codec.gen_prompt + action \
        + codec.after_turn(action, {"role": "user", "content": "out"}) + codec.gen_prompt
    full = msgs + [{"role": "assistant", "content": "ls"}, {"role": "user", "content": "out"}]
    assert tok.decode(ids) == tok.apply_chat_template(full, tokenize=False, add_generation_prompt=True)
    cut = tok.encode("ls", add_special_tokens=False)  # a turn cut at the length limit gets eos too
    assert tok.decode(cut + codec.after_turn(cut, {"role": "user", "content": "x"})) == "ls<|end|><|user|>x<|end|>"


def test_codec_rejects_templates_that_rerender(tiny):
    _, tok, _ = tiny

    class Weird:
        eos_token, eos_token_id = tok.eos_token, tok.eos_token_id

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return f"{len(messages)}|" + "".join(m["content"] for m in messages)

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=False)

    with pytest.raises(ValueError, match="re-rendered earlier messages"):
        ChatCodec(Weird())


def test_critic_values_start_at_zero(tiny):
    d, tok, _ = tiny
    critic = load_critic(d)
    ids = torch.randint(3, len(tok), (2, 7))
    v = critic(ids, torch.ones_like(ids))
    assert v.shape == (2, 6) and (v == 0).all()
    (v.sum() + critic.value_head.weight.sum()).backward()  # trainable end to end
