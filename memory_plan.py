"""The memory plan: what one rank holds in each phase of a training step, computed from the model's
config (built on the meta device: no weights, no memory) and train.py's flags, before anything
loads. `python train.py --plan ...` prints it; every run prints its summary and refuses to start
when a phase does not fit, naming the flags that would make it fit.

Per rank, with P parameters (actor), P_c (critic), W ranks, L decoder layers, T tokens of the
longest micro-batch (a window longer than --micro-batch-tokens gets one of its own), b the compute
dtype's bytes (2 for bf16 mixed precision, 4 for float32), b_e the engine's:
* sharded states (FSDP2): fp32 parameters 4P/W, Adam's two moments 8P/W, and in the model's own
  update its fp32 gradients 4P/W; on the host with --cpu-offload;
* gathered weights while a model runs: the root's (embeddings, final norm, head: FSDP2 does not
  reshard the root after forward) and two decoder layers (the current and the prefetched), and in
  backward their gradients, plus an fp32 copy of a layer's for the reduce-scatter;
* activations kept for backward: T·a per layer, with a (bytes per token per layer) what autograd
  saves in a Qwen3-style decoder layer (hidden H, attention q = heads·head_dim, kv =
  kv_heads·head_dim, MLP I): 4·(6H + 5q + 5kv + 4I) in float32, 2·(8H + 6q + 6kv + 4I) in bf16
  (the norms keep float32 copies); with --activation-checkpointing only each layer's input, T·H·b,
  plus one layer's activations while it is recomputed;
* the log-prob head: chunks of 512 positions × V logits, in b and in float32 (log-softmax,
  entropy, their gradients); in the update, where it fits (`choose_head`), also the float32
  log-softmax of all T positions, kept for backward;
* the engine: vLLM holds its weights (b_e·P), --kv-cache-gib and a workspace while awake (rollout,
  weight push) and releases them asleep (sleep level 1, GPU); HFEngine holds its weights always
  and, while generating, a KV cache for every episode of the rank at the longest window;
* the push: one full tensor in b_e (train.push_weights streams them) and its shard cast to b_e;
  on a CPU gloo's all-gather holds a second full buffer (NCCL gathers in place).
Peaks are per phase: rollout, score (old log-probs and values), critic, actor (updates), sync
(weight push). A phase fits when its peak, plus the runtime (RUNTIME_GPU: CUDA context, NCCL;
RUNTIME_CPU), is within the device memory less MARGIN (fragmentation, what is not modelled).

`PeakMeter` measures the same phases in a run: the CUDA allocator's peak on a GPU; on a CPU the
rise of the resident set's high-water mark over the resident set before any model loaded.
"""
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

import fsdp

GiB = 2**30
PHASES = ("rollout", "score", "critic", "actor", "sync")
MARGIN = 0.08
"""Share of the device memory the plan leaves free: the caching allocator's fragmentation."""
RUNTIME_GPU = int(1.5 * GiB)
"""CUDA context, cuBLAS workspaces and NCCL buffers of one rank: outside the allocator's count."""
RUNTIME_CPU = 64 * 2**20
"""What a CPU rank's resident set holds beside the tensors once the models load: Python objects,
the allocator's arenas, libraries loaded on first use (bench_memory.py measures it; its readings
are in docs/results.md)."""
VLLM_WORKSPACE_GPU = int(2 * GiB)
"""vLLM's own activations, sampler buffers and CUDA graphs beside its weights and KV cache (its
profile run at start-up measures them; this is the allowance)."""
HEAD_CHUNK = 512
"""model.Actor's chunk_size: positions whose logits exist at once."""


@dataclass(frozen=True)
class Shapes:
    """Parameter counts and dimensions of a model, read from its config on the meta device."""
    params: int  # actor (causal LM), tied weights once
    critic_params: int  # backbone and value head
    layers: int
    layer_params: int  # one decoder layer
    largest: int  # elements of the largest tensor of the state dict
    hidden: int
    intermediate: int
    q_dim: int  # attention heads × head_dim
    kv_dim: int  # key-value heads × head_dim
    vocab: int

    @property
    def root_params(self):
        return self.params - self.layers * self.layer_params

    @property
    def critic_root_params(self):
        return self.critic_params - self.layers * self.layer_params

    def kv_bytes_per_token(self, b):
        return 2 * self.layers * self.kv_dim * b

    def forward_bytes_per_token(self, b):
        """What one decoder layer's forward without autograd holds at once per token: its input
        and output, the attention's projections, the MLP's three intermediates."""
        return b * (4 * self.hidden + 2 * self.q_dim + 2 * self.kv_dim + 3 * self.intermediate)

    def activation_bytes_per_token(self, b):
        """a: what autograd saves per token in one decoder layer (module docstring)."""
        H, q, kv, intermediate = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        if b == 4:
            return 4 * (6 * H + 5 * q + 5 * kv + 4 * intermediate)
        return 2 * (8 * H + 6 * q + 6 * kv + 4 * intermediate)


def model_shapes(hf_cfg):
    """Shapes of the model `hf_cfg` describes: the actor and the critic's backbone are built on the
    meta device, so an 8B config costs no memory."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(hf_cfg)
    layers = fsdp.decoder_layers(lm)
    params = sum(p.numel() for p in lm.parameters())
    head = lm.get_output_embeddings().weight
    tied = head is lm.get_input_embeddings().weight
    H = hf_cfg.hidden_size
    head_dim = getattr(hf_cfg, "head_dim", None) or H // hf_cfg.num_attention_heads
    kv_heads = getattr(hf_cfg, "num_key_value_heads", None) or hf_cfg.num_attention_heads
    return Shapes(params=params, critic_params=params - (0 if tied else head.numel()) + H + 1, layers=len(layers),
                  layer_params=sum(p.numel() for p in layers[0].parameters()),
                  largest=max(t.numel() for t in lm.state_dict().values()), hidden=H,
                  intermediate=hf_cfg.intermediate_size, q_dim=hf_cfg.num_attention_heads * head_dim,
                  kv_dim=kv_heads * head_dim, vocab=hf_cfg.vocab_size)


@dataclass(frozen=True)
class Setup:
    """What the plan depends on besides the model: train.py's flags, resolved for one device."""
    world: int
    gpu: bool
    device_bytes: int
    mixed_precision: bool  # bf16 compute (GPU only)
    engine: str  # "vllm" or "hf"
    window: int  # T: tokens of the longest micro-batch
    longest: int  # tokens of the longest sequence (config.max_model_len)
    episodes: int  # rollouts per rank (HFEngine generates for all of them at once)
    kv_cache_bytes: int  # vLLM's KV cache
    max_new_tokens: int  # longest generation (HFEngine keeps its logits)
    activation_checkpointing: bool
    cpu_offload: bool
    save_head: bool = False  # the log-prob head keeps its log-softmax for backward (choose_head)


def plan(shapes, s):
    """{phase: {component: bytes}} for one rank, and the host bytes of what --cpu-offload moves."""
    W, b = s.world, 2 if s.mixed_precision else 4
    b_e = b
    P, Pc = shapes.params, shapes.critic_params
    states = {"actor fp32 shards": 4 * P // W, "critic fp32 shards": 4 * Pc // W, "Adam moments": 8 * (P + Pc) // W}
    offload = s.cpu_offload and s.gpu  # on a CPU the host is the device
    host = sum(states.values()) + 4 * max(P, Pc) // W if offload else 0
    resident = {} if offload else states
    engine_weights = b_e * P
    if s.engine == "vllm":
        generating = {"engine weights": engine_weights, "engine KV cache": s.kv_cache_bytes,
                      "engine workspace": VLLM_WORKSPACE_GPU if s.gpu else 0}
        # on GPUs vLLM sleeps between rollouts; a push wakes its weights only
        asleep, pushing = ({}, {"engine weights": engine_weights}) if s.gpu else (generating, generating)
    else:
        asleep = pushing = {"engine weights": engine_weights}
        # generate() runs every episode of the rank at once: KV cache, the prefill's layer
        # activations, and the logits of every new token (kept for the log-probs)
        generating = {**asleep, "engine KV cache": s.episodes * s.longest * shapes.kv_bytes_per_token(b_e),
                      "engine workspace": s.episodes * (s.longest * shapes.forward_bytes_per_token(b_e)
                                                        + 3 * s.max_new_tokens * shapes.vocab * 4)}
    out = {"rollout": {**resident, **generating}}
    T = s.window
    head = HEAD_CHUNK * shapes.vocab * (b + 6 * 4)  # logits in b, float32 copy, log-softmax, exp, grads
    if s.save_head:
        head += T * shapes.vocab * 4  # the float32 log-softmax of every position, kept for backward
    for phase, root, grads in (("critic", shapes.critic_root_params, Pc), ("actor", shapes.root_params, P)):
        gathered = root * 2 * b + shapes.layer_params * (3 * b + 4)  # params and grads; 2 layers; reduce copy
        if s.activation_checkpointing:
            acts = shapes.layers * T * shapes.hidden * b + T * shapes.activation_bytes_per_token(b)
        else:
            acts = shapes.layers * T * shapes.activation_bytes_per_token(b)
        acts += T * shapes.hidden * (2 * b + 4)  # embeddings out, final norm (its float32 copy), hidden out
        out[phase] = {**resident, **asleep, **({} if offload else {f"{phase} fp32 gradients": 4 * grads // W}),
                      "gathered weights and gradients": gathered, "activations": acts}
        if phase == "actor":
            out[phase]["log-prob head"] = head
    out["score"] = {**resident, **asleep, "gathered weights and gradients": shapes.root_params * b
                    + 2 * shapes.layer_params * b,
                    "activations": T * (shapes.forward_bytes_per_token(b) + 2 * shapes.hidden * b),
                    "log-prob head": HEAD_CHUNK * shapes.vocab * (b + 3 * 4)}
    # the largest tensor, its shard cast to b_e, and on a CPU the full buffer gloo gathers through
    cast = 1 / W if b_e != 4 else 0
    out["sync"] = {**resident, **pushing, "push buffer": shapes.largest * b_e * (1 + cast + (0 if s.gpu else 1))}
    return {p: {k: int(v) for k, v in out[p].items()} for p in PHASES}, host


def choose_head(shapes, s):
    """`s` with save_head set where the plan still fits with it: model.LogProbHead then keeps its
    log-softmax for backward and skips recomputing the head's logits there (one matmul of the
    head per chunk). At long windows and large vocabularies it does not fit, and the head keeps
    its O(chunk · V) memory."""
    saved = replace(s, save_head=True)
    return saved if fits(plan(shapes, saved)[0], saved) else replace(s, save_head=False)


def peaks(phases, s):
    """{phase: peak bytes} including the runtime."""
    return {p: sum(c.values()) + (RUNTIME_GPU if s.gpu else RUNTIME_CPU) for p, c in phases.items()}


def metered(shapes, s, record):
    """{phase: (measured, planned) bytes} for one step's metrics `record`: PeakMeter's figures
    (memory/<phase>) against the plan at the sizes the step reached (batch/longest_window,
    batch/micro_batch_tokens). On a GPU the meter reads the allocator, which the runtime is not in."""
    at = replace(s, window=int(record["batch/micro_batch_tokens"]), longest=int(record["batch/longest_window"]))
    planned = peaks(plan(shapes, at)[0], at)
    return {p: (record[f"memory/{p}"] * GiB, planned[p] - (RUNTIME_GPU if s.gpu else 0))
            for p in PHASES if f"memory/{p}" in record}


def fits(phases, s):
    return all(v <= s.device_bytes * (1 - MARGIN) for v in peaks(phases, s).values())


def remedies(shapes, s, cfg_flags):
    """The smallest sets of the flags that cut memory which make a plan that does not fit fit:
    each flag alone, else pairs, else all. cfg_flags: the knobs' current values (train.Config's)."""
    options = []
    if not s.activation_checkpointing:
        options.append(("--activation-checkpointing", {"activation_checkpointing": True}))
    if not s.cpu_offload and s.gpu:
        options.append(("--cpu-offload", {"cpu_offload": True}))
    if s.engine == "vllm" and s.kv_cache_bytes > GiB:
        options.append((f"--kv-cache-gib {cfg_flags['kv_cache_gib'] / 2:g}", {"kv_cache_bytes": s.kv_cache_bytes // 2}))
    for k in range(1, len(options) + 1):
        found = []
        for combo in itertools.combinations(options, k):
            alt = replace(s, **{key: v for _, change in combo for key, v in change.items()})
            if fits(plan(shapes, alt)[0], alt):
                found.append(" ".join(flag for flag, _ in combo))
        if found:
            return found
    return []


def describe(shapes, s, phases, host):
    """The plan as a table: components × phases, in GiB, then the peaks against the device."""
    names = list(dict.fromkeys(k for p in PHASES for k in phases[p]))
    width = max(len(n) for n in names + ["peak + runtime"])
    lines = [f"memory plan per rank: {_count(shapes.params)}-parameter actor, {_count(shapes.critic_params)} "
             f"critic, {s.world} ranks, {'bf16' if s.mixed_precision else 'fp32'} compute, {s.engine} engine, "
             f"longest micro-batch {s.window} tokens, activation checkpointing "
             f"{'on' if s.activation_checkpointing else 'off'}, CPU offload {'on' if s.cpu_offload else 'off'}, "
             f"log-prob head {'saves its log-softmax' if s.save_head else 'recomputes its chunks'}",
             f"{'GiB':<{width}} " + " ".join(f"{p:>8}" for p in PHASES)]
    for n in names:
        lines.append(f"{n:<{width}} " + " ".join(f"{phases[p].get(n, 0) / GiB:8.2f}" if n in phases[p] else
                                                  f"{'':>8}" for p in PHASES))
    pk = peaks(phases, s)
    lines.append(f"{'peak + runtime':<{width}} " + " ".join(f"{pk[p] / GiB:8.2f}" for p in PHASES))
    limit = s.device_bytes * (1 - MARGIN)
    lines.append(f"device {s.device_bytes / GiB:.1f} GiB, usable {limit / GiB:.1f} GiB (less {MARGIN:.0%} margin): "
                 + ("fits" if fits(phases, s) else "DOES NOT FIT in " +
                    ", ".join(p for p in PHASES if pk[p] > limit)))
    if host:
        lines.append(f"host memory per rank for the offloaded states: {host / GiB:.1f} GiB")
    return "\n".join(lines)


def _count(n):
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def summary(shapes, s, phases):
    pk = peaks(phases, s)
    worst = max(pk, key=pk.get)
    return (f"memory plan: peak {pk[worst] / GiB:.1f} GiB per rank ({worst}) of {s.device_bytes / GiB:.1f} GiB"
            f" ({'fits' if fits(phases, s) else 'does not fit'}; `train.py --plan` for the table)")


def device_bytes(gpu, local_ranks):
    """Memory of one rank's device: the GPU's, or on a CPU the host's shared by the local ranks."""
    if gpu:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    return total // max(1, local_ranks)


class PeakMeter:
    """Peak memory of each phase of a run, in bytes. GPU: torch.cuda.max_memory_allocated, reset at
    each phase's start (the trainer's and an HFEngine's tensors; vLLM's pool is outside it). CPU
    (Linux): the resident set's high-water mark (VmHWM, reset at each phase's start through
    /proc/self/clear_refs) less the resident set when the meter was made, before the models. The CPU
    figure counts every allocation, so it tracks tensors only when freed memory goes back to the
    system: run with MALLOC_MMAP_THRESHOLD_=65536 (glibc then maps every tensor of 64 KiB or more
    on its own, and unmaps it when freed)."""

    def __init__(self):
        self.gpu = torch.cuda.is_available()
        self.baseline = 0 if self.gpu else resident_bytes()
        self.last = {}  # {phase: peak bytes} of the phases measured since `take`

    @contextmanager
    def phase(self, name):
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_resident_peak()
        yield
        self.last[name] = torch.cuda.max_memory_allocated() if self.gpu else resident_bytes(peak=True) - self.baseline

    def take(self):
        """{phase: peak bytes} measured since the last call."""
        out, self.last = self.last, {}
        return out


def reset_resident_peak():
    """Reset this process's resident high-water mark (VmHWM) to its resident set (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def resident_bytes(peak=False):
    """This process's resident set (Linux), or its high-water mark since the last reset."""
    key = "VmHWM:" if peak else "VmRSS:"
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def tokens_per_micro_batch(micro_batch_tokens, longest_window):
    """T: the tokens of the largest micro-batch batch.pack_micro_batches can make: rows up
    to the budget, or one window longer than it on its own."""
    return max(micro_batch_tokens, longest_window)


def engine_fraction(shapes, s):
    """vLLM's gpu_memory_utilization: the share of the device its weights, KV cache and workspace
    take (5% more for what its profile finds beyond the allowance). vLLM checks at start that this
    much is free; the plan has checked that it is, beside the trainer's states."""
    need = (2 if s.mixed_precision else 4) * shapes.params + s.kv_cache_bytes + VLLM_WORKSPACE_GPU
    return round(min(1.0, 1.05 * need / s.device_bytes), 4)
