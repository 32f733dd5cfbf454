"""model.py with the real tiny transformers model: save/load, chunked log-probs and their
gradients (LogProbHead), packed rows against windows alone, engine/trainer log-prob agreement,
token-in/token-out chat rendering, the critic.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_model.py
"""
import os

import pytest
import torch
import torch.nn.functional as F

import batch
from engine import HFEngine
from model import (PACKED_ATTENTION, Actor, ChatCodec, Critic, LogProbHead, build_tiny_model, export_pretrained,
                   hf_config, load_policy, load_tokenizer, token_logprobs)
from train import tiny_corpus

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_model(d, tiny_corpus())
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
        lp, ent = token_logprobs(lm, ids, ids[:, 1:], temperature, chunk, attention_mask=attn)
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    # with a mask the head runs only on the masked positions; the others are 0
    mask = torch.zeros(3, 10)
    mask[0, 2:5] = 1
    mask[2, 7] = 1
    lp, ent = token_logprobs(lm, ids, ids[:, 1:], temperature, 2, mask, attention_mask=attn)
    torch.testing.assert_close(lp, ref * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent * mask, atol=1e-5, rtol=1e-5)
    # gradients through the checkpointed chunks equal those of the plain computation
    lm.zero_grad()
    token_logprobs(lm, ids, ids[:, 1:], temperature, 3, attention_mask=attn)[0].sum().backward()
    g_chunk = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    F.log_softmax(lm(ids, attention_mask=attn).logits[:, :-1].float() / temperature, -1) \
        .gather(-1, ids[:, 1:, None]).sum().backward()
    for a, p in zip(g_chunk, lm.parameters()):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)
    lm.zero_grad()


def plain_head(h, weight, bias, y, temperature):
    """The obviously correct head: full log-softmax, gather, entropy, under plain autograd."""
    logp = F.log_softmax(F.linear(h, weight, bias) / temperature, -1)
    return logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("save_softmax", [False, True])
@pytest.mark.parametrize("entropy", ["none", "metric", "loss"])
def test_log_prob_head_gradients_equal_plain_autograd(save_softmax, entropy):
    """LogProbHead's own backward (from the saved log-softmax or from recomputed chunks) against
    torch autograd through the plain head, in float64; the entropy gets a gradient in mode loss
    only, and gradcheck confirms the Jacobians numerically."""
    g = torch.Generator().manual_seed(0)
    N, H, V, t = 11, 6, 13, 0.7
    h = torch.randn(N, H, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)
    ref_lp, ref_ent = plain_head(h, w, b, y, t)
    ref_grads = torch.autograd.grad((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum() * (entropy == "loss"),
                                    (h, w, b))
    for chunk in (1, 4, N):
        lp, ent = LogProbHead.apply(h, w, b, y, t, chunk, entropy, save_softmax)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent, ref_ent if entropy != "none" else torch.zeros_like(ent),
                                   rtol=1e-12, atol=1e-12)
        assert ent.requires_grad == (entropy == "loss")
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy == "loss" else 0)
        for got, want in zip(torch.autograd.grad(loss, (h, w, b)), ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    outputs = (lambda lp, ent: lp + ent) if entropy == "loss" else (lambda lp, ent: lp)
    assert torch.autograd.gradcheck(lambda *a: outputs(*LogProbHead.apply(*a, y[:5], t, 2, entropy, save_softmax)),
                                    (h[:5].detach().requires_grad_(), w, b))


@pytest.mark.parametrize("save_softmax", [False, True])
def test_log_prob_head_keeps_a_full_log_softmax_only_when_asked(save_softmax):
    """What the head saves for backward: h, the weight and the targets when it recomputes its
    chunks (memory O(chunk · V) in backward too); and one (N, V) float32 log-softmax beside them
    when it saves it."""
    N, H, V = 64, 8, 500
    h, w = torch.randn(N, H, requires_grad=True), torch.randn(V, H, requires_grad=True)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        lp, _ = LogProbHead.apply(h, w, None, torch.randint(0, V, (N,)), 1.0, 16, "metric", save_softmax)
    assert sorted(shapes) == sorted([(N, H), (V, H), (N,)] + [(N, V)] * save_softmax)
    lp.sum().backward()


def qwen3_like(tmp_path):
    """A small model of the Qwen3-8B config's family: grouped-query attention (4 query heads per
    key-value head), an untied head, RMS-normed q and k."""
    from transformers import AutoModelForCausalLM
    cfg = hf_config(os.path.join(DATA, "qwen3-8b"))
    for key, value in {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}.items():
        setattr(cfg, key, value)
    cfg.layer_types = cfg.layer_types[:2]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize("family", ["tiny", "qwen3"])
def test_packed_rows_equal_windows_alone(tiny, tmp_path, family):
    """One packed row (batch.pack, attention PACKED_ATTENTION) gives each window the log-probs,
    entropies, gradients and critic values it gets when it runs alone (default attention, no
    padding), and the head runs where the mask says only."""
    from transformers import AutoModel, AutoModelForCausalLM
    path = tiny[0] if family == "tiny" else qwen3_like(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    packed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=PACKED_ATTENTION)
    critic = Critic(AutoModel.from_pretrained(path, attn_implementation=PACKED_ATTENTION), plain.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight)
    g = torch.Generator().manual_seed(1)
    lengths = [2, 9, 30, 5, 17]
    windows = [torch.randint(3, plain.config.vocab_size, (n,), generator=g) for n in lengths]
    masks = [(torch.rand(n - 1, generator=g) < 0.7).float() for n in lengths]
    ids, pos, (mask,) = batch.pack(windows, [masks])
    assert ids.shape == (1, sum(lengths)) and mask.shape == (1, sum(lengths) - 1)
    lp, ent = token_logprobs(packed, ids, ids[:, 1:], 0.9, 8, mask, position_ids=pos)
    (lp.sum() + ent.sum()).backward()
    values = critic(ids, pos)
    grads = {n: p.grad.clone() for n, p in packed.named_parameters()}
    for w, m, lp_w, ent_w, v_w in zip(windows, masks, *(batch.unpack(x, lengths) for x in (lp, ent, values))):
        ref_lp, ref_ent = token_logprobs(plain, w[None], w[None, 1:], 0.9, 8, m[None])
        torch.testing.assert_close(lp_w, ref_lp[0], rtol=1e-6, atol=2e-6)
        torch.testing.assert_close(ent_w, ref_ent[0], rtol=1e-6, atol=2e-6)
        (ref_lp.sum() + ref_ent.sum()).backward()
        critic.backbone.set_attn_implementation("sdpa")
        torch.testing.assert_close(v_w, critic(w[None])[0], rtol=1e-5, atol=1e-5)
        critic.backbone.set_attn_implementation(PACKED_ATTENTION)
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


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
                lp, _ = actor(ids, None, temperature)
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
    from transformers import AutoModel
    critic = Critic(AutoModel.from_pretrained(d), load_policy(d).config.hidden_size)
    ids = torch.randint(3, len(tok), (2, 7))
    v = critic(ids)
    assert v.shape == (2, 6) and (v == 0).all()
    (v.sum() + critic.value_head.weight.sum()).backward()  # trainable end to end
