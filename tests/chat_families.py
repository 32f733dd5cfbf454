"""Tokenizers of the chat-template families people train, built here with no network: a small
byte-level BPE with each family's special tokens, pre-tokenizer split and chat template
(tests/data/chat_templates/, written for these tests from each family's documented behaviour).

    tok = family_tokenizer("qwen3")
    codec = ChatCodec(tok, FAMILIES["qwen3"].template_kwargs(thinking=False))
"""
import copy
import functools
import os
from dataclasses import dataclass, field

import memory_task
from compaction import SUMMARY_INSTRUCTION

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat_templates")
# Qwen2's pre-tokenizer split: digits one by one, "\n" runs apart from words
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's: digits in runs of up to three
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Family:
    template: str  # file in TEMPLATES
    special: list  # special tokens, in id order
    eos: str
    pad: str
    split: str
    bos: str | None = None
    added: list = field(default_factory=list)  # added tokens that are not special (Qwen3's <think>)
    thinks: bool = False  # has a thinking switch (enable_thinking)

    def template_kwargs(self, thinking=True):
        return {"enable_thinking": thinking} if self.thinks else {}


FAMILIES = {
    "qwen3": Family("qwen3.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                    pad="<|endoftext|>", split=QWEN_SPLIT,
                    added=["<think>", "</think>", "<tool_response>", "</tool_response>"], thinks=True),
    "qwen2_5": Family("qwen2_5.jinja", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                      pad="<|endoftext|>", split=QWEN_SPLIT, added=["<tool_response>", "</tool_response>"]),
    "llama3": Family("llama3.jinja", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                     eos="<|eot_id|>", pad="<|end_of_text|>", bos="<|begin_of_text|>", split=LLAMA3_SPLIT),
    "glm4_5": Family("glm4_5.jinja", ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
                                      "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
                     eos="<|endoftext|>", pad="<|endoftext|>", split=QWEN_SPLIT,
                     added=["<think>", "</think>", "<tool_response>", "</tool_response>"], thinks=True),
}
# (family, thinking) pairs: the thinking families in both modes
VARIANTS = [(name, thinking) for name, f in FAMILIES.items() for thinking in ((True, False) if f.thinks else (True,))]


def chat_template(name):
    with open(os.path.join(TEMPLATES, FAMILIES[name].template)) as f:
        return f.read()


def family_tokenizer(name):
    """A PreTrainedTokenizerFast with the family's special tokens, split and chat template (a
    copy of its own: the caller may change it)."""
    return copy.deepcopy(_family_tokenizer(name))


@functools.lru_cache(maxsize=None)
def _family_tokenizer(name, vocab_size=700):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    fam = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(fam.split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=fam.special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    # role words and fragments of the special tokens become merges, so a forged token has parts to
    # reuse; "\n" runs too, so a message opening with blank lines tokenizes differently on its own
    corpus = [SUMMARY_INSTRUCTION, "system\nuser\nassistant\nipython\n im_start im_end eot_id header |> <|",
              "a\n\nb\n\n\nc", "```bash\nls -la\n```", "<think>\nplan\n</think>\n\n"] * 20
    tok.train_from_iterator(corpus + memory_task.corpus(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fam.eos, pad_token=fam.pad, bos_token=fam.bos,
                                 clean_up_tokenization_spaces=False)
    hf.add_tokens(fam.added)  # not special: they match in text, and decode keeps them
    hf.chat_template = chat_template(name)
    return hf
