"""The rollout engine's floor: the interface every engine meets (`Engine`, its output
`Generation`), transformers' engine (`HFEngine`) and `make_engine`, which picks one.

The agent loop (rollout.py) and every engine (vllm_engine.py, memory_task's demo engine) import
this module; it imports none of them, so engines do not depend on the loop that drives them.
"""
from dataclasses import dataclass

import torch

from model import hf_config, load_policy, rope_overrides


@dataclass
class Generation:
    """One engine output: sampled ids (including the stop token if one was sampled) and the
    log-prob of each under the sampling distribution softmax(logits / temperature)."""
    token_ids: list
    logprobs: list
    finish_reason: str  # "stop" | "length"


class Engine:
    """Interface of a rollout engine (HFEngine here; vllm_engine.VLLMEngine behind the same one).

    An engine with only `generate` is served in batches: scheduler.py gathers the pending requests
    into one call. An engine that batches continuously (vLLM) also has `submit`, `step` and
    `abort`, and requests join and leave its running batch one engine step at a time."""

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        """prompts: list of token-id lists; max_new_tokens: one int per prompt; seeds: one int per
        prompt, or None to draw them from torch's global generator. -> [Generation], in order.

        A seeded engine draws each prompt's sampling noise from that prompt's seed alone, so what
        it samples for a prompt does not depend on what the prompt was batched with."""
        raise NotImplementedError

    dtype = torch.float32
    """The dtype the engine computes in: pushed weights are cast to it before they are gathered."""

    def capacity(self, window_tokens):
        """How many windows of `window_tokens` tokens the engine's KV cache holds at once; None
        when it keeps nothing between calls (HFEngine recomputes every prompt)."""
        return None

    def load_weights(self, named_tensors):
        """Replace the weights with (name, tensor) pairs in Hugging Face naming, from any iterable:
        a generator streams them (each is copied in before the next is made)."""
        raise NotImplementedError

    def sleep(self):
        """Free memory between rollouts (a no-op where unsupported)."""

    def wake_up(self):
        """Undo `sleep` before the next rollout."""

    def close(self):
        """Release the engine at the end of the job (a no-op where there is nothing to release)."""


class HFEngine(Engine):
    """transformers `generate`, batched and left-padded. Sampling is pure softmax(logits / T),
    drawn by Gumbel-max with noise from each prompt's own seed (`GumbelNoise`): top-k and top-p
    are off, so the returned log-probs are those of the distribution actually sampled (the trainer
    divides its logits by the same T), and a prompt's sample does not depend on its batch."""

    def __init__(self, model, pad_token_id):
        self.model = model.eval()
        self.pad = pad_token_id
        self.dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        if temperature <= 0:
            raise ValueError("HFEngine samples; temperature must be > 0")
        if seeds is None:
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        device = next(self.model.parameters()).device
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), self.pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            attn[i, L - len(p):] = 1
        # Greedy decoding over logits / T + Gumbel noise is sampling from softmax(logits / T).
        out = self.model.generate(input_ids=ids.to(device), attention_mask=attn.to(device),
                                  do_sample=False, logits_processor=[GumbelNoise(seeds, temperature)],
                                  max_new_tokens=max(max_new_tokens), eos_token_id=stop_token_ids,
                                  pad_token_id=self.pad, output_logits=True,
                                  return_dict_in_generate=True)
        new = out.sequences[:, L:].cpu()  # (B, N)
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (B, N, V) raw logits
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, new[..., None])[..., 0]
        results = []
        for i in range(len(prompts)):
            toks, lps = [], []
            for t in range(min(new.shape[1], max_new_tokens[i])):
                toks.append(int(new[i, t]))
                lps.append(float(logp[i, t]))
                if toks[-1] in stop_token_ids:
                    break
            stopped = bool(toks) and toks[-1] in stop_token_ids
            results.append(Generation(toks, lps, "stop" if stopped else "length"))
        return results

    @torch.no_grad()
    def load_weights(self, named_tensors):
        own = self.model.state_dict()  # views of the parameters (tied ones under each name)
        for name, t in named_tensors:
            if name not in own:
                raise KeyError(f"HFEngine.load_weights: {name} is not a weight of {type(self.model).__name__}")
            own[name].copy_(t)


class GumbelNoise:
    """A transformers logits processor: scores / T plus Gumbel noise, each row's drawn from a
    generator of its own, seeded per prompt. Every row draws V numbers at every step whatever its
    batch holds, so row i's tokens are a function of its prompt and seed alone."""

    def __init__(self, seeds, temperature):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.temperature = temperature

    def __call__(self, input_ids, scores):  # scores: (B, V)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-20)))
        return scores.float() / self.temperature + gumbel.to(scores.device)


def make_engine(kind, model_path, pad_token_id, device, seed=0, max_model_len=None, kv_cache_bytes=None,
                dtype=None, rope_scaling=None, memory_fraction=None):
    """The rollout engine for `model_path`: kind is "hf", "vllm" or "auto" (vLLM when it is
    installed and a GPU is present). vllm_engine is imported only when vLLM is asked for; options
    left at None keep VLLMEngine's defaults (HFEngine's dtype: float32). Both engines run the model
    with the config the trainer uses (model.hf_config: `rope_scaling` applied). `seed` is vLLM's
    start-up seed. Sampling draws from torch's global generator (HFEngine: the per-request seeds
    run_episodes derives from it; vLLM: its noise), so a reproducible rollout is seeded with
    torch.manual_seed by its caller."""
    if kind == "auto":
        import importlib.util
        kind = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"
    if kind == "vllm":
        from transformers import AutoConfig

        from vllm_engine import VLLMEngine  # optional: vllm need not be installed
        opts = {k: v for k, v in (("kv_cache_bytes", kv_cache_bytes), ("memory_fraction", memory_fraction),
                                  ("dtype", dtype)) if v is not None}
        return VLLMEngine(model_path, max_model_len=max_model_len, seed=seed,
                          hf_overrides=rope_overrides(AutoConfig.from_pretrained(model_path), rope_scaling),
                          **opts)
    return HFEngine(load_policy(model_path, dtype=getattr(torch, dtype or "float32"), device=device,
                                config=hf_config(model_path, rope_scaling)), pad_token_id)
