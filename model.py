"""The model layer: policy and critic, the embedded tiny default, attention over packed rows,
chunked log-probs, and token-in/token-out chat rendering.

Shape legend: B = sequences, L = tokens per sequence, T = L − 1 target positions, V = vocab,
H = hidden size. Every per-token output is aligned with the targets input_ids[:, 1:]: position t
holds log π(x_{t+1} | x_{≤t}) and the value V(x_{≤t}) of the state before token t+1 is sampled.

* `Actor` / `Critic` are thin nn.Modules whose forward is the whole computation, so FSDP2 can
  shard their decoder layers and treat the wrapper as the root (the root's pre-forward hook
  gathers the embeddings, final norm and head for the duration of the forward).
* The critic is the same checkpoint's backbone with a scalar head (docs/method.md, 'The critic
  target'), zero-initialized so
  the first values are 0.
* `ChatCodec` renders each new message once, to ids, and appends them; sampled ids are never
  decoded and re-encoded, so the trainer sees exactly the ids the sampler saw (docs/method.md,
  'Windows are the samples'). Message
  content is inert: special tokens come only from the template, so a file or command output
  that contains "<|im_end|>" cannot forge a turn boundary.
"""
import os
import re

import torch
import torch.nn.functional as F
from torch import nn

SPECIAL_TOKENS = ["<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]

# Phi-3-style roles, one special token each, and no newlines: a turn costs its content plus two
# tokens (role, <|end|>), where ChatML's "<|im_start|>user\n ... <|im_end|>\n" costs five. For
# the tiny model's short turns that halves every context window, and with it the CPU cost of a
# training step. {% generation %} marks the assistant tokens for `return_assistant_tokens_mask`.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- message['content'] + '<|end|>' -}}{% endgeneration %}"
    "{%- else -%}{{- message['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def build_tiny_model(out_dir, corpus, vocab_size=1024, hidden_size=64, num_layers=2, num_heads=2,
                     head_dim=32, intermediate_size=256, max_positions=2048, init_std=0.1, seed=0):
    """Write a tiny Qwen3-style causal LM and its tokenizer to `out_dir`, with no network.

    Byte-level BPE (any UTF-8 text round-trips) trained locally with `tokenizers` on `corpus` (a
    list of strings: the entry script's prompts, so they become few tokens); special tokens
    for pad/eos and each chat role; a compact Phi-3-style template (CHAT_TEMPLATE). head_dim 32
    because vLLM's CPU attention accepts head_dim in {32, 64, 80, ...}. `init_std` replaces HF's
    0.02 default: a tiny random model with std 0.02 has near-uniform outputs and RL from it stalls.
    Returns out_dir; load it with `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    # no model_max_length: the model's config holds its position limit (vLLM would cap a rope-
    # scaled model's length at the tokenizer's)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                     eos_token="<|end|>", padding_side="left")
    hf_tok.chat_template = CHAT_TEMPLATE
    pad_id, eos_id = hf_tok.convert_tokens_to_ids(["<|endoftext|>", "<|end|>"])
    cfg = Qwen3Config(vocab_size=len(hf_tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_heads, head_dim=head_dim,
                      max_position_embeddings=max_positions, tie_word_embeddings=True,
                      initializer_range=init_std, pad_token_id=pad_id, eos_token_id=eos_id,
                      bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(pad_token_id=pad_id, eos_token_id=eos_id, do_sample=True,
                                               top_k=0, top_p=1.0)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    hf_tok.save_pretrained(out_dir)
    return out_dir


def check_positions(path, longest, parts, rope_scaling=None, hint=""):
    """Raise when `longest` tokens (made of `parts`, the flags that size it) pass the model's
    positions under `rope_scaling`: RoPE past its range raises in vLLM and silently degrades in
    transformers. `hint` is appended to the advice ("lower those flags")."""
    limit = hf_config(path, rope_scaling).max_position_embeddings
    if longest > limit:
        scaling = f"YaRN {rope_scaling}" if rope_scaling else "no rope scaling"
        raise ValueError(f"the longest sequence, {longest} tokens ({parts}), is past {path}'s {limit} positions "
                         f"(max_position_embeddings, {scaling}): lower those flags{hint}")


def hf_config(path, rope_scaling=None):
    """The model's transformers config as train.py runs it, on the trainer and in every engine:
    `rope_overrides` applied, and dropout off (the sampler never drops out, and PPO's ratio
    compares the trainer with it; the trainer runs in training mode, where dropout would act)."""
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    for key, value in rope_overrides(cfg, rope_scaling).items():
        setattr(cfg, key, value)
    for key, value in list(vars(cfg).items()):
        if ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    return cfg


def rope_overrides(hf_cfg, rope_scaling):
    """Config keys that switch the model's RoPE to YaRN (Peng et al. 2023) with
    rope_scaling = (factor, original max positions): positions up to factor × original, the
    model's new limit. The same dict goes to the trainer's config (`hf_config`) and to vLLM
    (`hf_overrides`), so both compute the same positions. {} when rope_scaling is None."""
    if rope_scaling is None:
        return {}
    factor, original = rope_scaling
    if factor <= 1 or original <= 0:
        raise ValueError(f"--rope-scaling needs a factor > 1 and an original length > 0, got {rope_scaling}")
    rope = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
            "rope_theta": (hf_cfg.rope_parameters or {}).get("rope_theta", getattr(hf_cfg, "rope_theta", None))}
    if rope["rope_theta"] is None:
        raise ValueError(f"--rope-scaling: the {hf_cfg.model_type} config has no rope_theta; is it a RoPE model?")
    return {"rope_parameters": rope, "max_position_embeddings": int(factor * original)}


def load_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_policy(path, dtype=torch.float32, device="cpu", config=None):
    """The policy: any causal LM by Hugging Face id or local path (with `config`, e.g.
    `hf_config`'s, instead of its own)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, config=config).to(device)


PACKED_ATTENTION = "compactionrl_packed_sdpa"
"""The trainer's attention implementation (registered with transformers' AttentionInterface):
`packed_sdpa`."""


def packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None,
                sliding_window=None, **kwargs):
    """Causal attention over a packed row (batch.pack): windows concatenated into one sequence,
    position_ids restarting at 0 where each begins. Each window attends only to itself, by one
    causal SDPA call per window: exact, and with no (N, N) block-diagonal mask to build or to
    read, so the kernel runs as fast as on the windows alone.

    query (1, heads, N, D); key, value (1, kv_heads, N, D). Returns ((1, N, heads, D), None), as
    transformers' attention functions do. Sliding windows and soft-capping are not supported."""
    if query.shape[0] != 1 or position_ids is None or attention_mask is not None:
        raise ValueError(f"{PACKED_ATTENTION} takes one packed row with position_ids and no attention mask "
                         f"(batch.pack); got batch {query.shape[0]}, position_ids "
                         f"{'given' if position_ids is not None else 'None'}, mask {attention_mask is not None}")
    if sliding_window is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{PACKED_ATTENTION}: sliding-window and soft-capped attention")
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
    if starts[0] != 0:
        raise ValueError(f"{PACKED_ATTENTION}: a packed row starts at position 0")
    gqa = key.shape[1] != query.shape[1]
    out = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], dropout_p=dropout,
                                          is_causal=True, scale=scaling, enable_gqa=gqa)
           for a, b in zip(starts[:-1], starts[1:])]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _register_packed_attention():
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED_ATTENTION, packed_sdpa)


_register_packed_attention()


class Actor(nn.Module):
    """Wraps a causal LM; forward returns per-token log-probs (and entropies) of the targets of
    a packed row. `save_softmax`: the log-prob head keeps its log-softmax for backward instead of
    recomputing it (LogProbHead), where the memory plan says the whole of it fits."""

    def __init__(self, lm, chunk_size=512, save_softmax=False):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.save_softmax = save_softmax

    def forward(self, input_ids, position_ids, temperature=1.0, mask=None, entropy="metric"):
        return token_logprobs(self.lm, input_ids, input_ids[:, 1:], temperature, self.chunk_size, mask,
                              position_ids=position_ids, entropy=entropy, save_softmax=self.save_softmax)


class Critic(nn.Module):
    """The same checkpoint's backbone with a scalar value head: one value per token."""

    def __init__(self, backbone, hidden_size):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, position_ids=None):
        h = self.backbone(input_ids=input_ids, position_ids=position_ids).last_hidden_state
        # clone: FSDP2 must not hand out a view of its output (an in-place op would skip its hooks)
        return self.value_head(h[:, :-1]).squeeze(-1).float().clone()  # (B, T): V before each target


ENTROPY = ("none", "metric", "loss")
"""What token_logprobs does with the entropy: none (zeros), metric (computed, no gradient: for
the log), loss (in the autograd graph: an entropy bonus)."""


def token_logprobs(model, input_ids, targets, temperature=1.0, chunk_size=512, mask=None, attention_mask=None,
                   position_ids=None, entropy="metric", save_softmax=False):
    """log softmax(logits / temperature) of each target token, and the entropy at each position.

    input_ids: (B, L), one packed row (position_ids, batch.pack) or right-padded rows
    (attention_mask); targets: (B, T) with T = L − 1 (the next tokens); mask: optional (B, T) —
    when given, the LM head runs only where mask is nonzero (trainable tokens are a small part of
    an agent's context) and the other positions are 0.
    The head (LogProbHead) runs on chunks of `chunk_size` positions, so its memory is
    O(chunk·V), not O(B·T·V), unless `save_softmax` keeps the log-softmax for backward.
    Returns (logprobs, entropy), both (B, T) float32.
    """
    if entropy not in ENTROPY:
        raise ValueError(f"entropy must be one of {ENTROPY}, got {entropy!r}")
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids).last_hidden_state
    hidden = hidden[:, :-1]  # (B, T, H): the state before each target
    B, T = targets.shape
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask[:, :T] != 0
    h, y = hidden[keep], targets[keep]  # (N, H), (N,)
    head = model.get_output_embeddings()
    lp, ent = LogProbHead.apply(h, head.weight, head.bias, y, temperature, chunk_size, entropy,
                                save_softmax and torch.is_grad_enabled())
    lp_all = hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(keep, lp.float())
    ent_all = hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(keep, ent.float())
    return lp_all, ent_all


class LogProbHead(torch.autograd.Function):
    """The LM head, log-softmax, gather of the targets' log-probs and (optionally) the entropy,
    chunk by chunk over positions, with its own backward: only a chunk's (c, V) logits exist at
    once, where a plain log_softmax(head(h)).gather holds (N, V) in several copies.

    forward(h (N, H), weight (V, H), bias (V,) or None, targets (N,), temperature, chunk_size,
    entropy (ENTROPY), save_softmax) -> (logprobs (N,), entropy (N,)), float32 (float64 for
    float64 inputs).
    Backward, per chunk, with z the logits / temperature, p = softmax(z), H the entropy:
        ∂ log p_y / ∂z = onehot(y) − p,   ∂H / ∂z = −p ⊙ (log p + H)
    from the saved log-softmax (save_softmax: N·V floats) or from a recomputed chunk (one more
    matmul of the head per chunk). The entropy is in the graph only in mode "loss"; in "metric"
    it is computed beside the log-probs (an elementwise pass) and has no gradient."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature, chunk_size, entropy, save_softmax):
        lps, ents, saved = [], [], None
        for s in range(0, len(targets), chunk_size):
            logp = _chunk_log_softmax(h[s:s + chunk_size], weight, bias, temperature)  # (c, V)
            lps.append(logp.gather(-1, targets[s:s + chunk_size, None])[:, 0])
            if entropy != "none":
                ents.append(-(logp.exp() * logp).sum(-1))
            if save_softmax:  # written into one (N, V) buffer: no second copy from a final cat
                if saved is None:
                    saved = logp.new_empty(len(targets), logp.shape[-1])
                saved[s:s + chunk_size] = logp
        lp = torch.cat(lps) if lps else h.new_zeros(0, dtype=torch.float32)
        ent = torch.cat(ents) if ents else torch.zeros_like(lp)
        ctx.save_for_backward(h, weight, bias, targets, *([saved] if saved is not None else []))
        ctx.temperature, ctx.chunk_size, ctx.entropy = temperature, chunk_size, entropy
        if entropy != "loss":
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, weight, bias, targets, *saved = ctx.saved_tensors
        c, t = ctx.chunk_size, ctx.temperature
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        with_entropy = ctx.entropy == "loss" and g_ent is not None
        for s in range(0, len(targets), c):
            hs = h[s:s + c]
            logp = saved[0][s:s + c] if saved else _chunk_log_softmax(hs, weight, bias, t)
            p = logp.exp()
            gl = g_lp[s:s + c, None]
            gz = (-p * gl).scatter_add_(1, targets[s:s + c, None], gl)  # g·(onehot(y) − p)
            if with_entropy:
                ent = -(p * logp).sum(-1, keepdim=True)
                gz -= g_ent[s:s + c, None] * p * (logp + ent)
            gz = (gz / t).to(h.dtype)  # (c, V): the gradient of the logits
            if grad_h is not None:
                grad_h[s:s + c] = gz @ weight
            if grad_w is not None:
                grad_w += gz.T @ hs
            if grad_b is not None:
                grad_b += gz.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _chunk_log_softmax(h, weight, bias, temperature):
    z = F.linear(h, weight, bias)  # (c, V), in the compute dtype; the softmax in float32 or wider
    return F.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)) / temperature, dim=-1)


def export_pretrained(lm, tokenizer, out_dir, state_dict=None):
    """`save_pretrained` (safetensors) of the policy, loadable by transformers and vLLM.
    `state_dict`: full (unsharded) tensors, e.g. gathered from FSDP2 on rank 0."""
    os.makedirs(out_dir, exist_ok=True)
    lm.save_pretrained(out_dir, state_dict=state_dict)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# While the template renders, each message's content is replaced by a slot: private-use code
# points, which no template emits. The contents themselves never pass through the template.
_SLOT = "\ue000{}\ue001"
_SLOT_RE = re.compile("\ue000(\\d+)\ue001")
# The content of the probe assistant turn, after which `after_turn` reads what a template renders.
_TURN = "\ue002"
# Probe messages with whitespace around their content: they tell whether a template keeps it.
_HEAD = [{"role": "system", "content": " \nsys\n "}, {"role": "user", "content": "\n usr \n"}]


class ChatCodec:
    """Token-in/token-out chat rendering with a model's own chat template.

    A context is built once, piece by piece, and never re-rendered: prompt([system, user]),
    gen_prompt, the sampled ids, after_turn(sampled ids, observation), gen_prompt, ... and, after
    a message, message(m) (the summary instruction after an observation). Every piece is
    tokenized once; the trainer scores exactly the ids the sampler saw.

    What a template must do for this, checked at construction (a template that does not is
    refused, naming the reason, before any model loads):
    * A non-assistant message renders the same whatever came before it: message(m) is the text
      that render(h + [m]) adds to render(h).
    * After an assistant turn come a fixed close (possibly empty) and then message(m). The
      template may render the assistant turn itself differently once it is no longer the last:
      Qwen3 and GLM-4.5 drop the reasoning of earlier turns, and Qwen3 gives only the last turn
      an empty <think></think> block. The context keeps the ids the policy sampled, as it sampled
      them; only what follows them is taken from the template (the delta it renders for the next
      message). So past reasoning stays in the context, where the template would drop it.
    * The first token after the assistant's content is a special token: the one the policy
      samples to end its turn, `stop_ids` (<|im_end|> in ChatML, <|eot_id|> in Llama 3; in
      GLM-4.5, which has no end-of-turn token, the next message's role token <|user|>). When the
      policy sampled it, `after_turn` continues after it; after a turn cut at the length cap it
      is injected. Observations and instructions are user messages, so that is the role probed.
    * Content renders verbatim, or stripped of surrounding whitespace (Llama 3's `| trim`): then
      it is stripped here first, and renders verbatim.
    `template_kwargs` (e.g. {"enable_thinking": False}) go to every rendering.

    Special tokens come only from the template's own text. The rendered text is cut at them, and
    every stretch between two of them (template text and message content alike) is encoded with
    special-token matching off (`encode_text`): a "<|im_end|>" inside an observation becomes
    ordinary tokens that decode back to the same text. That is also how the tokenizer itself
    encodes text (cut at special tokens, then each stretch on its own), so text without
    special-token strings gets exactly the ids of `tokenizer.encode(rendered text)`. Assumed:
    the template's special tokens match as plain strings (no lstrip/rstrip/single_word).
    Non-special added tokens (e.g. Qwen's <think>) still match in content, as they would anyway.

    Thread safety: after construction the codec holds no mutable state, and its inert encoder is
    a private copy that nothing else touches, so it may be called from any thread.
    """

    def __init__(self, tokenizer, template_kwargs=None):
        self.tok = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._strip = self._content_rule()
        base = self._render(_HEAD)
        with_gp = self._render(_HEAD, add_generation_prompt=True)
        if not with_gp.startswith(base):
            raise ValueError("chat template: the generation prompt changes the messages before it; "
                             "token-in/token-out appends it to them")
        self._turn = _HEAD + [{"role": "assistant", "content": _TURN}]
        probe = {"role": "user", "content": "V"}
        after_message, after_turn = self._delta(_HEAD, probe), self._delta(self._turn, probe)
        if after_turn[1:] != after_message[1:] or not after_turn[0].endswith(after_message[0]):
            raise ValueError(f"chat template: a user message renders as {''.join(after_turn)!r} after an "
                             f"assistant turn but as {''.join(after_message)!r} after a message; "
                             f"token-in/token-out needs the same message after a fixed turn close")
        self._inert = _inert_backend(tokenizer)
        self._special = _special_token_ids(tokenizer)
        # longest first: a regex alternation takes the first alternative that matches, and the
        # tokenizer matches the longest special token at a position
        names = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, names)) + ")" if names else "(?!)")
        ids = self._encode_pieces(after_turn)
        if ids[0] not in self._special.values():
            raise ValueError(f"chat template: an assistant turn is followed by {after_turn[0]!r}, which does "
                             f"not start with a special token the policy could sample to end its turn")
        self._stop = ids[0]
        self.stop_ids = [ids[0]]  # what the engines stop on
        self.gen_prompt = self._encode_pieces([with_gp[len(base):]])

    def _render(self, messages, add_generation_prompt=False):
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            **self.template_kwargs)

    def _content_rule(self):
        """True when the template strips message content (then the codec strips it first), False
        when it renders content verbatim; any other rewrite is refused."""
        for strip in (False, True):
            self._strip = strip
            try:
                self._pieces(_HEAD)
                return strip
            except _ContentChanged:
                pass
        raise ValueError("chat template changes message content beyond stripping whitespace; inert "
                         "content needs it rendered verbatim")

    def encode(self, text):
        """The tokenizer's plain encoding: special-token strings become special ids. For template
        text only; text from the environment goes through `encode_text`."""
        return self.tok.encode(text, add_special_tokens=False)

    def encode_text(self, text):
        """Ids of `text` with special-token matching off: no special id, and decode gives `text`
        back. How message content (observations, tasks, summaries) is tokenized."""
        return self._inert.encode(text, add_special_tokens=False).ids

    def prompt(self, messages):
        """Ids of a full conversation start (no generation prompt)."""
        return self._encode_pieces(self._pieces(messages))

    def message(self, message):
        """Ids of one non-assistant message as it renders after another message."""
        return self._encode_pieces(self._delta(_HEAD, message))

    def after_turn(self, sampled_ids, message):
        """Ids that follow a sampled assistant turn: the rest of its close, then `message` (a user
        message). The stop token is not repeated when the policy sampled it; after a turn cut at
        the length cap it is injected."""
        ids = self._encode_pieces(self._delta(self._turn, message))
        if ids[:1] != [self._stop]:
            raise ValueError(f"a {message['role']!r} message after an assistant turn does not start with the "
                             f"turn's stop token {self._stop} (probed with a user message)")
        stopped = len(sampled_ids) > 0 and sampled_ids[-1] in self.stop_ids
        return ids[1:] if stopped else ids

    def _delta(self, history, message):
        """[text, content, text]: what rendering `message` after `history` adds. After a message,
        the rendering of `history` must not change; after the probe assistant turn, what follows
        its content is taken (the turn itself may render differently once it is not the last)."""
        pieces = self._pieces(history + [message], first=len(history))
        if history[-1]["role"] == "assistant":
            at = pieces[0].rfind(_TURN)
            if at < 0:
                raise ValueError("chat template drops the content of an earlier assistant turn")
            pieces[0] = pieces[0][at + len(_TURN):]
            return pieces
        before = self._render(history)
        if not pieces[0].startswith(before):
            raise ValueError("chat template re-rendered earlier messages when a message was appended")
        pieces[0] = pieces[0][len(before):]
        return pieces

    def _pieces(self, messages, first=0):
        """The template's rendering of `messages`, cut around the content of messages[first:]:
        [text, content, text, content, ..., text], whose concatenation is the rendering."""
        slotted = messages[:first] + [dict(m, content=_SLOT.format(i))
                                      for i, m in enumerate(messages[first:])]
        pieces = _SLOT_RE.split(self._render(slotted))  # slot numbers at the odd positions
        if pieces[1::2] != [str(i) for i in range(len(messages) - first)]:
            raise ValueError("chat template does not render each message's content once, in order")
        pieces[1::2] = [m["content"].strip() if self._strip else m["content"] for m in messages[first:]]
        if "".join(pieces) != self._render(messages):
            raise _ContentChanged("chat template changes message content (rewrites it, or renders "
                                  "around it depending on what it says); inert content needs it "
                                  "rendered verbatim")
        return pieces

    def _encode_pieces(self, pieces):
        """Ids of [text, content, ..., text]: special tokens are matched in the template's text
        only; each stretch between them, content included, is encoded with `encode_text`."""
        ids, stretch = [], ""
        for i, piece in enumerate(pieces):
            if i % 2:  # message content: never cut
                stretch += piece
                continue
            for j, part in enumerate(self._special_re.split(piece)):  # special tokens at odd j
                if j % 2:
                    ids += self.encode_text(stretch) + [self._special[part]]
                    stretch = ""
                else:
                    stretch += part
        return ids + self.encode_text(stretch)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


class _ContentChanged(ValueError):
    """A template rendered message content other than verbatim (or stripped, where it strips)."""


def _special_token_ids(tokenizer):
    """{text: id} of every special token: the named ones (eos, pad, ...) and the added tokens
    marked special, which is all a chat template's role tokens often are."""
    ids = set(tokenizer.all_special_ids)
    ids |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return {tokenizer.convert_ids_to_tokens(i): i for i in ids}


def _inert_backend(tokenizer):
    """A private copy of a fast tokenizer's backend (`tokenizers.Tokenizer`) that never matches
    special tokens: their strings in text become ordinary byte/BPE tokens.

    Why a copy rather than transformers' `split_special_tokens=True` call argument: that argument
    sets `encode_special_tokens` on the tokenizer's shared backend, where it stays until the next
    call resets it, so two threads encoding at once would race. Nothing mutates this copy after
    construction. Padding and truncation are switched off: ids of text are wanted whole."""
    from tokenizers import Tokenizer
    if not hasattr(tokenizer, "backend_tokenizer"):
        raise TypeError("ChatCodec needs a fast (tokenizers-backed) tokenizer for inert content")
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.encode_special_tokens = True
    backend.no_padding()
    backend.no_truncation()
    return backend
