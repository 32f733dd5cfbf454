"""The model layer: policy and critic, the embedded tiny default, chunked log-probs, and
token-in/token-out chat rendering.

Shape legend: B = sequences, L = tokens per sequence, T = L − 1 target positions, V = vocab,
H = hidden size. Every per-token output is aligned with the targets input_ids[:, 1:]: position t
holds log π(x_{t+1} | x_{≤t}) and the value V(x_{≤t}) of the state before token t+1 is sampled.

* `Actor` / `Critic` are thin nn.Modules whose forward is the whole computation, so FSDP2 can
  shard their decoder layers and treat the wrapper as the root (the root's pre-forward hook
  gathers the embeddings, final norm and head for the duration of the forward).
* The critic is the same checkpoint's backbone with a scalar head (SPEC §5), zero-initialized so
  the first values are 0.
* `ChatCodec` renders each new message once, to ids, and appends them; sampled ids are never
  decoded and re-encoded, so the trainer sees exactly the ids the sampler saw (SPEC §2). Message
  content is inert: special tokens come only from the template, so a file or command output
  that contains "<|im_end|>" cannot forge a turn boundary.
"""
import os
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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


def _tokenizer_corpus():
    """Text the embedded BPE is trained on: the agent's own prompts and a little shell/Python,
    so frequent prompt fragments become few tokens and contexts stay short."""
    from compaction import RESUME_WITH_TASK, SUMMARY_INSTRUCTION
    from memory_task import corpus as memory_corpus
    shell = ["```bash\nls -la\n```", "```bash\ncat src/utils.py\n```", "```bash\npython -m pytest -q\n```",
             "def add(a, b):\n    return a + b\n", "Traceback (most recent call last):\n  File",
             "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "returncode: 0\noutput:\n", "git diff\n"]
    return [SUMMARY_INSTRUCTION, RESUME_WITH_TASK] * 20 + shell * 5 + memory_corpus()


def build_tiny_model(out_dir, vocab_size=1024, hidden_size=64, num_layers=2, num_heads=2,
                     head_dim=32, intermediate_size=256, max_positions=2048, init_std=0.1, seed=0):
    """Write a tiny Qwen3-style causal LM and its tokenizer to `out_dir`, with no network.

    Byte-level BPE (any UTF-8 text round-trips) trained locally with `tokenizers`; special tokens
    for pad/eos and each chat role; a compact Phi-3-style template (CHAT_TEMPLATE). head_dim 32
    because vLLM's CPU attention accepts head_dim in {32, 64, 80, ...}. `init_std` replaces HF's
    0.02 default: a tiny random model with std 0.02 has near-uniform outputs and RL from it stalls
    (notes/toy-memory-task).
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
    tok.train_from_iterator(_tokenizer_corpus(), trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                     eos_token="<|end|>", padding_side="left",
                                     model_max_length=max_positions)
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


def load_tokenizer(path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_policy(path, dtype=torch.float32, device="cpu"):
    """The policy: any causal LM by Hugging Face id or local path."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


class Actor(nn.Module):
    """Wraps a causal LM; forward returns per-token log-probs (and entropies) of the targets."""

    def __init__(self, lm, chunk_size=512):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size

    def forward(self, input_ids, attention_mask, temperature=1.0, mask=None):
        return token_logprobs(self.lm, input_ids, attention_mask, input_ids[:, 1:], temperature,
                              self.chunk_size, mask)


class Critic(nn.Module):
    """The same checkpoint's backbone with a scalar value head: one value per token."""

    def __init__(self, backbone, hidden_size):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # clone: FSDP2 must not hand out a view of its output (an in-place op would skip its hooks)
        return self.value_head(h[:, :-1]).squeeze(-1).float().clone()  # (B, T): V before each target


def load_critic(path, dtype=torch.float32, device="cpu"):
    from transformers import AutoConfig, AutoModel
    cfg = AutoConfig.from_pretrained(path)
    backbone = AutoModel.from_pretrained(path, dtype=dtype)  # the causal LM's trunk, no LM head
    return Critic(backbone, cfg.hidden_size).to(device=device, dtype=dtype)


def token_logprobs(model, input_ids, attention, targets, temperature=1.0, chunk_size=512, mask=None):
    """log softmax(logits / temperature) of each target token, and the entropy at each position.

    input_ids, attention: (B, L); targets: (B, T) with T = L − 1 (the next tokens); mask: optional
    (B, T) — when given, the LM head runs only where mask is nonzero (trainable tokens are a small
    part of an agent's context) and the other positions are 0.
    The head runs on chunks of `chunk_size` positions and, under autograd, each chunk is
    recomputed in backward (activation checkpointing), so memory stays O(chunk·V), not O(B·T·V).
    Returns (logprobs, entropy), both (B, T) float32.
    """
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention).last_hidden_state
    hidden = hidden[:, :-1]  # (B, T, H): the state before each target
    B, T = targets.shape
    keep = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask[:, :T] != 0
    h, y = hidden[keep], targets[keep]  # (N, H), (N,)
    head = model.get_output_embeddings()
    lps, ents = [], []
    for s in range(0, max(len(y), 1), chunk_size):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_head_logprobs, head, h[s:s + chunk_size], y[s:s + chunk_size],
                                 temperature, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(head, h[s:s + chunk_size], y[s:s + chunk_size], temperature)
        lps.append(lp)
        ents.append(ent)
    lp_all = hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(keep, torch.cat(lps))
    ent_all = hidden.new_zeros(B, T, dtype=torch.float32).masked_scatter(keep, torch.cat(ents))
    return lp_all, ent_all


def _head_logprobs(head, h, y, temperature):
    logp = F.log_softmax(head(h).float() / temperature, dim=-1)  # (c, V)
    entropy = -(logp.exp() * logp).sum(-1)  # (c,)
    return logp.gather(-1, y.unsqueeze(-1)).squeeze(-1), entropy


def token_values(critic, input_ids, attention):
    """Critic values aligned with the targets: (B, T)."""
    return critic(input_ids, attention)


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


class ChatCodec:
    """Token-in/token-out chat rendering for templates that render messages independently
    (ChatML and its kin: ours, Qwen, Phi-3, ...). Checked at construction; other templates get an error.

    ids = prompt(messages) then, per turn: gen_prompt, sampled ids, close(sampled ids, stopped),
    message(observation), ... Every piece is tokenized once, and the context is their concatenation.

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

    def __init__(self, tokenizer):
        self.tok = tokenizer
        sys_user = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
        base = self._render(sys_user)
        with_gp = self._render(sys_user, add_generation_prompt=True)
        with_a = self._render(sys_user + [{"role": "assistant", "content": "XYZ"}])
        if not with_gp.startswith(base) or not with_a.startswith(base):
            raise ValueError("chat template does not render messages independently (a prefix "
                             "changed when a message was added); token-in/token-out needs it")
        gen_prompt = with_gp[len(base):]
        after = with_a[len(base):]
        if not after.startswith(gen_prompt) or "XYZ" not in after:
            raise ValueError(f"cannot locate the assistant turn in the template output {after!r}")
        self._dummy = sys_user + [{"role": "assistant", "content": "XYZ"}]
        self._dummy_text = with_a
        turn_end = after[after.index("XYZ") + 3:]
        eos_text = tokenizer.eos_token
        if not turn_end.startswith(eos_text):
            raise ValueError(f"the assistant turn must end with eos {eos_text!r}, got {turn_end!r}")
        self._inert = _inert_backend(tokenizer)
        self._special = _special_token_ids(tokenizer)
        # longest first: a regex alternation takes the first alternative that matches, and the
        # tokenizer matches the longest special token at a position
        names = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, names)) + ")" if names else "(?!)")
        # fail here, not in the middle of a run, when the template trims or rewrites content
        self._pieces([{"role": "system", "content": " \nS\n "}, {"role": "user", "content": "\n U \n"}])
        self.gen_prompt = self._encode_pieces([gen_prompt])
        self.close_after_stop = self._encode_pieces([turn_end[len(eos_text):]])
        self.close_after_cut = self._encode_pieces([turn_end])
        self.stop_ids = [tokenizer.eos_token_id]

    def _render(self, messages, add_generation_prompt=False):
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)

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
        """Ids of one non-assistant message as it renders after an assistant turn."""
        pieces = self._pieces(self._dummy + [message], first=len(self._dummy))
        if not pieces[0].startswith(self._dummy_text):
            raise ValueError("chat template re-rendered earlier messages when one was appended")
        return self._encode_pieces([pieces[0][len(self._dummy_text):]] + pieces[1:])

    def _pieces(self, messages, first=0):
        """The template's rendering of `messages`, cut around the content of messages[first:]:
        [text, content, text, content, ..., text], whose concatenation is the rendering."""
        slotted = messages[:first] + [dict(m, content=_SLOT.format(i))
                                      for i, m in enumerate(messages[first:])]
        pieces = _SLOT_RE.split(self._render(slotted))  # slot numbers at the odd positions
        if pieces[1::2] != [str(i) for i in range(len(messages) - first)]:
            raise ValueError("chat template does not render each message's content once, in order")
        pieces[1::2] = [m["content"] for m in messages[first:]]
        if "".join(pieces) != self._render(messages):
            raise ValueError("chat template changes message content (trims or rewrites it); "
                             "inert content needs it rendered verbatim")
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

    def close(self, sampled_ids):
        """Ids that end an assistant turn: the template's suffix after eos when the model stopped,
        or eos + suffix when generation was cut at the length limit."""
        stopped = len(sampled_ids) > 0 and sampled_ids[-1] in self.stop_ids
        return self.close_after_stop if stopped else self.close_after_cut

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)


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
