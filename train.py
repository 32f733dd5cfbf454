"""CompactionRL trainer: PPO with a critic, context compaction, cross-trajectory GAE and the
token-level normalized loss (docs/method.md).

    python train.py                                   # CPU: tiny embedded model, memory task
    torchrun --nproc_per_node=2 train.py              # the same on 2 CPU processes (gloo)
    python train.py --task swe                        # CPU: tiny model, built-in SWE tasks (preset swe)
    python train.py --task swe --sandbox docker       # the same in their Docker images
    torchrun --nproc_per_node=8 train.py --preset swe-paper --model Qwen/Qwen3-8B \
        --tasks my_swe_rows.jsonl                     # GPUs (nccl), the paper's settings

Presets (config.PRESETS, listed by --help) give the defaults; every flag overrides them.

Each step reads like the algorithm box: (1) rollouts with compaction on this rank's share of
tasks → (2) old log-probs and values → (3) advantages and returns → (4) critic updates →
(5) PPO policy update, normalized by the global trainable-token count Z → (6) push the new
weights to the rollout engine → (7) metrics, trajectory dump (text, and report.py's JSONL and
report.html), checkpoint.

Where the CPU defaults depart from the paper (every paper value is in config.py, by its field):
the tiny model and the memory task; a short supervised warm-up (memory_task.WarmupDemoEngine)
that teaches a random-initialized model the shape of each turn, to answer with a key that is in
its context, and that a summary repeats one observation line — picked at RANDOM, so after it a
compacted episode succeeds by chance only; a learning rate for a 10^6-parameter model, not a
10^10 one. That the summary must keep the key is learned by RL alone, credited through
cross-trajectory GAE.
"""
import os
import warnings
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

import fsdp
import memory_plan
import memory_task
import report
import rundir
from advantage import (adaptive_lambda, concatenated_gae, correction_factor, cross_trajectory_gae,
                       group_advantage, rollout_lengths, segment_gae, whiten_segments)
from batch import assign_groups, micro_batches, minibatch_indices, pack_micro_batches, pad, to_rows, unpack
from compaction import RESUME_WITH_TASK, SUMMARY_INSTRUCTION
from config import GLUE_TOKENS, Config, finalize, flat, max_model_len, parse_config
from engine import make_engine
from loss import finalize_metrics, normalizer_weights, ppo_policy_loss, value_loss
from metrics import (Logger, explained_variance, merge_sums, plot_curve, reduce_sums, rollout_metrics,
                     segment_share_metrics, step_line, timed)
from model import (PACKED_ATTENTION, Actor, ChatCodec, Critic, build_tiny_model, check_positions, export_pretrained,
                   hf_config, load_tokenizer)
from rollout import format_episode, run_episodes


# --- (0) set-up ---------------------------------------------------------------------------------

def make_models(cfg, model_path, device, actor_only=False, save_softmax=False):
    """The actor and critic, sharded (fsdp.load_sharded), running packed rows (batch.pack) with
    the per-window attention model.PACKED_ATTENTION. save_softmax: the memory plan's choice for
    the log-prob head (memory_plan.choose_head)."""
    from transformers import AutoModel, AutoModelForCausalLM
    mp = cfg.model.mixed_precision and device.type == "cuda"
    hf_cfg = hf_config(model_path, cfg.model.rope_scaling)
    attn = {"attn_implementation": PACKED_ATTENTION}

    def build_actor(meta):
        lm = AutoModelForCausalLM.from_config(hf_cfg, **attn) if meta else \
            AutoModelForCausalLM.from_pretrained(model_path, config=hf_cfg, dtype=torch.float32, **attn)
        return Actor(lm, save_softmax=save_softmax)

    def build_critic(meta):
        backbone = AutoModel.from_config(hf_cfg, **attn) if meta else \
            AutoModel.from_pretrained(model_path, config=hf_cfg, dtype=torch.float32, **attn)
        return Critic(backbone, hf_cfg.hidden_size)

    actor = fsdp.load_sharded(build_actor, device, mp, cfg.model.activation_checkpointing, cfg.model.cpu_offload)
    if actor_only:
        return actor
    critic = fsdp.load_sharded(build_critic, device, mp, cfg.model.activation_checkpointing, cfg.model.cpu_offload)
    return actor, critic


def engine_for(cfg, model_path, pad_id, device, memory_fraction=None):
    """This rank's rollout engine. memory_fraction: vLLM's share of the device, from the memory
    plan (memory_plan.engine_fraction), not vLLM's default 0.9 of a device the trainer shares."""
    return make_engine(cfg.model.engine, model_path, pad_id, device, seed=cfg.run.seed + dist.get_rank(),
                       max_model_len=max_model_len(cfg.rollout), kv_cache_bytes=int(cfg.model.kv_cache_gib * 2**30),
                       dtype="bfloat16" if cfg.model.mixed_precision and device.type == "cuda" else "float32",
                       rope_scaling=cfg.model.rope_scaling, memory_fraction=memory_fraction)


def make_envs(cfg, step, rank, per_rank, warmup=False, swe_rows=None):
    """This rank's share of the step's tasks: group_size rollouts per task, one env each.
    Deterministic in (seed, step, rank), so the data position is the step number. `swe_rows`:
    the SWE task rows, loaded once (check_inputs)."""
    n_tasks = per_rank // cfg.optim.group_size
    if cfg.task.name == "memory":
        tasks = memory_task.make_tasks(n_tasks, seed=(cfg.run.seed * 1_000_003 + step) * 1009 + rank,
                                       n_keys=cfg.task.memory_keys, n_noise=cfg.task.memory_noise,
                                       p_short=cfg.optim.warmup_p_short if warmup else cfg.task.memory_p_short,
                                       max_key_at=cfg.optim.warmup_max_key_at if warmup else cfg.task.memory_max_key_at,
                                       filler=cfg.task.memory_filler)
        make = memory_task.MemoryEnv
    else:
        import swe_task
        start = (step * cfg.optim.rollouts_per_step // cfg.optim.group_size + rank * n_tasks)
        tasks = [swe_rows[(start + i) % len(swe_rows)] for i in range(n_tasks)]
        sandbox = swe_task.docker_sandbox_factory() if cfg.task.sandbox == "docker" else \
            swe_task.local_sandbox_factory(isolated=not cfg.task.allow_unisolated)
        make = lambda row: swe_task.SWEEnv(row, sandbox, command_timeout=cfg.task.command_timeout,  # noqa: E731
                                           eval_timeout=cfg.task.eval_timeout)
    tasks = [t for t in tasks for _ in range(cfg.optim.group_size)]
    return [make(t) for t in tasks], [t.get("task_id", t.get("instance_id")) for t in tasks]


def rollout_config(cfg):
    """The agent loop's limits, with the memory task's own short summary instruction and resume
    message."""
    if cfg.task.name != "memory":
        return cfg.rollout
    return replace(cfg.rollout, summary_instruction=memory_task.SUMMARY_INSTRUCTION,
                   resume_template=memory_task.RESUME)


def prepare_run(cfg, rank, world, device):
    """The start-up checks and the run folder (rundir.py), before any model is loaded; a check
    that fails on one rank raises on every rank. Returns (model path, checkpoint to resume or None,
    the SWE task rows or None, the memory plan: (Shapes, Setup, phases))."""
    swe_rows = fsdp.fail_together(lambda: check_inputs(cfg))
    fsdp.fail_together(lambda: rundir.probe_writable(cfg.run.out_dir, f".write_probe_rank{rank}"))
    fsdp.fail_together(lambda: rundir.prepare_out_dir(cfg.run.out_dir, cfg.run.resume, cfg.run.overwrite),
                       rank0_only=True)
    ckpt_root = os.path.join(cfg.run.out_dir, "checkpoints")
    resume_from = fsdp.latest_valid_checkpoint(ckpt_root) if cfg.run.resume else None  # verifies the files
    if cfg.run.resume and resume_from is None:
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_root} to continue from; start a new "
                                f"run without --resume (with --overwrite to replace {cfg.run.out_dir})")
    model_path = cfg.model.path or os.path.join(cfg.run.out_dir, "tiny_model")

    def write_run_files():
        rundir.write_config(cfg.run.out_dir, flat(cfg))
        if not cfg.model.path:  # the embedded default: written by rank 0, read by all
            rundir.ensure_tiny_model(model_path, tiny_model_args(cfg), cfg.run.resume,
                                     partial(build_tiny_model, corpus=tiny_corpus()))
    fsdp.fail_together(write_run_files, rank0_only=True)
    fsdp.fail_together(lambda: check_model(cfg, model_path))
    setup = memory_setup(cfg, world, device.type == "cuda")
    shapes, setup, phases = fsdp.fail_together(lambda: check_memory(cfg, model_path, setup))
    return model_path, resume_from, swe_rows, (shapes, setup, phases)


def memory_setup(cfg, world, gpu):
    """memory_plan.Setup of this config on `world` ranks of a GPU (or CPU)."""
    import importlib.util
    engine = cfg.model.engine
    if engine == "auto":
        engine = "vllm" if gpu and importlib.util.find_spec("vllm") else "hf"
    device_bytes = int(cfg.model.device_memory_gib * 2**30) or \
        memory_plan.device_bytes(gpu, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    longest = max_model_len(cfg.rollout)
    return memory_plan.Setup(
        world=world, gpu=gpu, device_bytes=device_bytes, mixed_precision=cfg.model.mixed_precision and gpu,
        engine=engine, window=memory_plan.tokens_per_micro_batch(cfg.optim.micro_batch_tokens, longest),
        longest=longest,
        episodes=cfg.optim.rollouts_per_step // world, kv_cache_bytes=int(cfg.model.kv_cache_gib * 2**30),
        max_new_tokens=max(cfg.rollout.max_action_tokens, cfg.rollout.max_summary_tokens),
        activation_checkpointing=cfg.model.activation_checkpointing, cpu_offload=cfg.model.cpu_offload)


def check_memory(cfg, model_path, setup):
    """The memory plan of this run (memory_plan.py) from the model's config: raises, with the plan
    and the flags that would make it fit, when a phase does not fit the device. Returns (Shapes,
    the Setup with the log-prob head's mode chosen, {phase: {component: bytes}})."""
    shapes = memory_plan.model_shapes(hf_config(model_path, cfg.model.rope_scaling))
    setup = memory_plan.choose_head(shapes, setup)
    phases, host = memory_plan.plan(shapes, setup)
    if not memory_plan.fits(phases, setup):
        fixes = memory_plan.remedies(shapes, setup, {"kv_cache_gib": cfg.model.kv_cache_gib})
        raise MemoryError(memory_plan.describe(shapes, setup, phases, host) + "\n" + (
            f"It fits with {' or with '.join(fixes)}." if fixes else
            "No flag of the plan makes it fit: shorten the longest window (--context-budget, --max-summary-tokens, "
            "--max-observation-tokens), or spread the states over more ranks."))
    return shapes, setup, phases


def print_plan(cfg, world):
    """--plan: print the memory plan of this configuration, loading no model (the embedded tiny
    model is built in a temporary folder). Exits with status 1 when it does not fit."""
    import tempfile
    world = cfg.model.plan_world or world
    finalize(cfg, world)
    gpu = torch.cuda.is_available() if cfg.model.plan_device == "auto" else cfg.model.plan_device == "cuda"
    if gpu and not torch.cuda.is_available() and not cfg.model.device_memory_gib:
        raise ValueError("--plan-device cuda without a GPU here: give its memory with --device-memory-gib")
    with tempfile.TemporaryDirectory() as tmp:
        model_path = cfg.model.path or build_tiny_model(tmp, tiny_corpus(), **tiny_model_args(cfg))
        shapes = memory_plan.model_shapes(hf_config(model_path, cfg.model.rope_scaling))
    setup = memory_plan.choose_head(shapes, memory_setup(cfg, world, gpu))
    phases, host = memory_plan.plan(shapes, setup)
    print(memory_plan.describe(shapes, setup, phases, host))
    if setup.engine == "vllm" and gpu:
        print(f"vLLM gpu_memory_utilization: {memory_plan.engine_fraction(shapes, setup)}")
    if not memory_plan.fits(phases, setup):
        fixes = memory_plan.remedies(shapes, setup, {"kv_cache_gib": cfg.model.kv_cache_gib})
        print(f"It fits with {' or with '.join(fixes)}." if fixes else "No flag of the plan makes it fit.")
        return 1
    return 0


def check_model(cfg, model_path):
    """What the model must allow, checked from its config and tokenizer alone: the longest
    sequence within its positions (RoPE past its range raises in vLLM and silently degrades in
    transformers), and a chat template the codec can follow."""
    r = cfg.rollout
    check_positions(model_path, max_model_len(r),
                    f"--context-budget {r.context_budget} + --max-observation-tokens {r.max_observation_tokens} + "
                    f"--max-summary-tokens {r.max_summary_tokens} + {GLUE_TOKENS}", cfg.model.rope_scaling,
                    ", or extend the positions with --rope-scaling FACTOR ORIGINAL "
                    "(YaRN; Qwen3: --rope-scaling 4 32768)")
    ChatCodec(load_tokenizer(model_path), template_kwargs(cfg))  # raises, naming what the template lacks


def template_kwargs(cfg):
    """Variables every chat-template rendering gets; templates without them ignore them."""
    return {"enable_thinking": cfg.model.thinking}


def check_inputs(cfg):
    """Flags and input files that would otherwise fail after the models load. Returns the SWE
    task rows (None for the memory task)."""
    asked = (("--tensorboard", cfg.log.tensorboard), ("--wandb", cfg.log.wandb))
    rundir.check_optional_packages([flag for flag, on in asked if on])
    if cfg.task.name != "swe":
        return None
    import swe_task
    from sandbox import check_docker_images, check_isolation
    source = cfg.task.tasks or swe_task.BUILTIN_TASKS_FILE
    rows = swe_task.load_tasks(source, cfg.task.tasks_split)
    if cfg.task.sandbox == "docker":
        check_docker_images(sorted({r["image"] for r in rows}), pull=cfg.task.pull_images)
    else:
        swe_task.check_local_rows(rows, source)
        if not cfg.task.allow_unisolated:
            check_isolation()  # no agent command runs unconfined unless the user says so
    return rows


def check_prompts(cfg, codec, swe_rows):
    """--task swe: every task's first prompt fits the window (swe_task.check_prompts_fit). Needs
    only the tokenizer: it runs before any model loads."""
    if swe_rows is not None:
        import swe_task
        swe_task.check_prompts_fit(swe_rows, codec, cfg.rollout.context_budget, cfg.rollout.reserve,
                                   cfg.task.command_timeout)


def tiny_corpus():
    """Text the embedded tokenizer is trained on (model.build_tiny_model): the agent's prompts of
    both tasks and a little shell/Python, so frequent prompt fragments become few tokens and
    contexts stay short. eval_swebench.py builds its tiny model from it too."""
    shell = ["```bash\nls -la\n```", "```bash\ncat src/utils.py\n```", "```bash\npython -m pytest -q\n```",
             "def add(a, b):\n    return a + b\n", "Traceback (most recent call last):\n  File",
             "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "returncode: 0\noutput:\n", "git diff\n"]
    return [SUMMARY_INSTRUCTION, RESUME_WITH_TASK] * 20 + shell * 5 + memory_task.corpus()


def tiny_model_args(cfg):
    """build_tiny_model's arguments for the embedded model (kept beside it: a change rebuilds it)."""
    m = cfg.model
    return {"hidden_size": m.tiny_hidden, "num_layers": m.tiny_layers, "num_heads": m.tiny_heads,
            "intermediate_size": 4 * m.tiny_hidden, "max_positions": 8192,  # RoPE room for max_model_len
            "seed": cfg.run.seed}


# --- (2) old log-probs and values ---------------------------------------------------------------

@torch.no_grad()
def score(actor, critic, rows, cfg, device, ref=None):
    """log π_old and V_old (and log π_ref with a KL penalty) at every target position (log-probs
    only where the mask is 1, 0 elsewhere)."""
    for mb, b in micro_batches(rows, list(range(len(rows))), cfg.optim.micro_batch_tokens, device):
        ids, pos, mask = b["input_ids"], b["position_ids"], b["mask"]
        out = {"old_logprobs": actor(ids, pos, cfg.rollout.temperature, mask, entropy="none")[0],
               "old_values": critic(ids, pos)}
        if ref is not None:
            out["ref_logprobs"] = ref(ids, pos, cfg.rollout.temperature, mask, entropy="none")[0]
        lengths = [len(rows[i]["ids"]) for i in mb or []]
        for key, packed in out.items():
            for i, x in zip(mb or [], unpack(packed.float().cpu(), lengths)):
                rows[i][key] = x


# --- (3) advantages and returns -----------------------------------------------------------------

def advantages(rows, cfg, group_ids):
    """Â and the critic target G for every row (docs/method.md, 'Advantages'); all segments of a
    rollout are local.
    Writes rows[i]["advantages"], ["returns"], and the row's λ and N_after ["lambda"], ["n_after"]
    (report.py dumps them). Returns sums for the log: Σ λ over trainable tokens, and Σ (γλ)^N_after
    and the token count over windows that have a later one (eq. 14's factor, whichever estimator
    runs)."""
    mask = pad([r["mask"] for r in rows]).double()
    values = pad([r["old_values"] for r in rows]).double() * mask
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    rid = torch.tensor([r["rollout_id"] for r in rows])
    seg = torch.tensor([r["segment_index"] for r in rows])
    n_after, total = rollout_lengths(mask, rid, seg)
    if cfg.algorithm.lam_mode == "fixed":
        lam = cfg.algorithm.lam
    else:
        length = total if cfg.algorithm.lam_mode == "rollout" else mask.sum(1)
        lam = adaptive_lambda(length, cfg.algorithm.lam_alpha)  # (B,) one λ per rollout (or per segment)
    estimator = cfg.algorithm.estimator
    if estimator == "cross-trajectory":
        adv, ret = cross_trajectory_gae(values, mask, rewards, n_after, cfg.algorithm.gamma, lam)
    elif estimator == "concatenated":
        adv, ret = concatenated_gae(values, mask, rewards, rid, seg, cfg.algorithm.gamma, lam)
    elif estimator == "per-segment":
        adv, ret = segment_gae(values, mask, rewards, cfg.algorithm.gamma, lam)
    else:
        adv = group_advantage(mask, rewards, torch.tensor(group_ids), rid)
        ret = rewards[:, None] * mask
    if cfg.algorithm.critic_target == "mc":
        ret = rewards[:, None] * mask
    lam_rows = torch.as_tensor(lam, dtype=torch.float64).expand(len(rows))
    for i, r in enumerate(rows):
        T = len(r["mask"])
        r["advantages"], r["returns"] = adv[i, :T].float(), ret[i, :T].float()
        r["lambda"], r["n_after"] = float(lam_rows[i]), int(n_after[i])  # for the report's dump
    tokens, early = mask.sum(1), (n_after > 0).double()
    factor = correction_factor(n_after, cfg.algorithm.gamma, lam_rows)  # (B,) eq. (14)
    return {"lambda": float((lam_rows * tokens).sum()), "correction": float((factor * tokens * early).sum()),
            "early_tokens": float((tokens * early).sum())}


# --- (4)/(5) optimization -------------------------------------------------------------------------

def optimize(module, optimizer, rows, idx, loss_fn, cfg, device, keys):
    """One optimizer step over the mini-batch rows[idx] on every rank.

    The denominator (Z for the token normalizer) is all-reduced ONCE; each micro-batch adds
    loss_sum / denom · world_size (the ×world_size undoes FSDP's gradient averaging), so the
    result is independent of how the mini-batch is split (docs/method.md, 'Token-level
    normalization'; tests/test_loss.py).
    A non-finite loss or gradient skips the step on every rank. Returns (metric sums over this
    rank's tokens, {"loss", "grad_norm"} of the step — global values, the same on every rank —,
    1 if the step was skipped else 0).
    """
    world = dist.get_world_size()
    local_w = {}
    denom_local = torch.zeros((), dtype=torch.float64)
    if idx:
        m = pad([rows[i]["mask"] for i in idx])
        w, denom_local = normalizer_weights(m, torch.tensor([rows[i]["rollout_id"] for i in idx]),
                                            cfg.algorithm.normalizer)
        for j, i in enumerate(idx):
            local_w[i] = w[j, :len(rows[i]["mask"])]
    denom = float(fsdp.all_reduce(denom_local))
    if denom <= 0:
        return {}, {}, 0
    for i in idx:
        rows[i]["weights"] = local_w[i]
    sums, loss_total = {}, torch.zeros((), dtype=torch.float64)
    for mb, b in micro_batches(rows, idx, cfg.optim.micro_batch_tokens, device, keys + ("weights",)):
        loss_sum, metrics = loss_fn(module, b)
        (loss_sum / denom * world).backward()
        loss_total += loss_sum.detach().double().cpu()
        merge_sums(sums, metrics)
    grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.optim.grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    loss_total = fsdp.all_reduce(loss_total)
    finite = bool(torch.isfinite(grad_norm).item()) and bool(torch.isfinite(loss_total).item())
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums, {"loss": float(loss_total) / denom, "grad_norm": float(grad_norm)}, int(not finite)


def policy_loss_fn(cfg):
    a = cfg.algorithm
    # the entropy enters the graph only when it is in the loss; else it is computed for the log
    entropy = "loss" if a.entropy_coef else "metric"

    def fn(actor, b):
        lp, ent = actor(b["input_ids"], b["position_ids"], cfg.rollout.temperature, b["mask"], entropy)
        if "advantages" not in b:  # dummy micro-batch: zero loss, same collectives
            return (lp * 0).sum(), {}
        loss, metrics = ppo_policy_loss(lp, b["old_logprobs"], b["advantages"], b["mask"],
                                        a.clip_low, a.clip_high, a.dual_clip or None, token_weights=b["weights"])
        ent_sum = (ent * b["mask"] * b["weights"]).sum()
        metrics["entropy"] = (ent * b["mask"]).sum().detach()
        loss = loss - a.entropy_coef * ent_sum
        if "ref_logprobs" in b:  # k3: exp(r) − r − 1 with r = log π_ref − log π_θ, ≥ 0
            r = b["ref_logprobs"] - lp
            kl = ((torch.exp(r) - r - 1) * b["mask"])
            loss = loss + a.kl_coef * (kl * b["weights"]).sum()
            metrics["kl_ref"] = kl.sum().detach()
        return loss, metrics
    return fn


def value_loss_fn(cfg):
    def fn(critic, b):
        v = critic(b["input_ids"], b["position_ids"])
        if "returns" not in b:
            return (v * 0).sum(), {}
        return value_loss(v, b["old_values"], b["returns"], b["mask"], cfg.algorithm.value_clip or None,
                          token_weights=b["weights"])
    return fn


def sft_loss_fn(cfg):
    def fn(actor, b):
        lp, _ = actor(b["input_ids"], b["position_ids"], 1.0, b["mask"], entropy="none")
        return -(lp * b["mask"] * b.get("weights", 1.0)).sum(), {"tokens": b["mask"].sum().detach()}
    return fn


def adam(params, lr):
    """torch's fused Adam (one kernel updates every parameter, where the for-each implementation
    makes several passes over them); where this torch build has none for the parameters' device,
    the for-each one, with a warning that says why."""
    params = list(params)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except RuntimeError as e:  # raised at construction: unsupported device or dtype
        warnings.warn(f"fused Adam is not available here ({e}); using the for-each implementation")
        return torch.optim.Adam(params, lr=lr)


def push_weights(actor, engine, device):
    """(6) Stream the policy's weights into this rank's rollout engine: each tensor is gathered
    from its FSDP2 shards in the engine's dtype and loaded before the next is gathered (a
    collective, every rank in the same order), so the push adds one tensor to memory, not a copy
    of the model. The trainer's cached blocks are released first: the engine wakes its weights."""
    fsdp.release_cached_memory()
    engine.load_weights((k.removeprefix("lm."), v) for k, v in fsdp.iter_full_tensors(actor, device, engine.dtype))


def warmup(actor, cfg, codec, rank, per_rank, device, print0):
    """Supervised steps on demo episodes (memory task; see the module docstring). The episodes
    come from the real rollout loop, so the format includes compaction and resumption."""
    demo = memory_task.WarmupDemoEngine(codec, cfg.task.memory_keys, seed=cfg.run.seed * 7919 + rank)
    opt = adam(actor.parameters(), cfg.optim.warmup_lr)
    n = min(per_rank, 64)
    for w in range(cfg.optim.warmup_steps):
        envs, tids = make_envs(cfg, -1 - w, rank, n * cfg.optim.group_size, warmup=True)
        eps = run_episodes(demo, codec, envs, rollout_config(cfg), list(range(len(envs))), tids)
        rows = to_rows([s for e in eps for s in e.segments], "trained")
        _, stats, _ = optimize(actor, opt, rows, list(range(len(rows))), sft_loss_fn(cfg), cfg, device, ())
        if w % 10 == 0 or w == cfg.optim.warmup_steps - 1:
            print0(f"warm-up {w + 1}/{cfg.optim.warmup_steps}: nll/token {stats.get('loss', 0):.3f}")


def critic_from_policy(critic, actor):
    """The critic's trunk := the policy's. The method starts the critic from the policy that RL
    starts from; after a warm-up that is not the checkpoint both were loaded from. The value head
    keeps its zero init. Works on FSDP2 shards alike: both trunks are sharded the same way."""
    prefix = "lm.model."
    critic.backbone.load_state_dict({k[len(prefix):]: v for k, v in actor.state_dict().items()
                                     if k.startswith(prefix)})


def trainable_episodes(episodes, keep_env_errors=False, mask_truncated=False):
    """The episodes that enter the batch. Not one that sampled no token (its prompt alone
    overflowed C); by default not one a sandbox or grader failure ended (env_error: not the
    policy's doing, so neither its reward 0 nor its tokens say anything about the policy); with
    SUPO-style overlong masking, only those that submitted."""
    return [e for e in episodes if sum(s.n_tokens for s in e.segments) > 0
            and (keep_env_errors or e.end_reason != "env_error")
            and not (mask_truncated and e.end_reason != "submitted")]


def batch_sizes(rows, minibatches, budget):
    """The sizes the memory plan assumes at their worst: the longest window, and the tokens of the
    largest micro-batch (scoring packs all rows, an update one mini-batch), global maxima; and
    the tokens of all windows, a global sum (what one pass over the batch processes)."""
    lengths = [len(r["ids"]) for r in rows]
    packed = [sum(lengths[i] for i in mb)
              for idx in [list(range(len(rows)))] + minibatches
              for mb in ([idx[j] for j in b] for b in pack_micro_batches([lengths[i] for i in idx], budget))]
    worst = fsdp.all_reduce([max(lengths, default=0), max(packed, default=0)], dist.ReduceOp.MAX)
    return {"batch/longest_window": float(worst[0]), "batch/micro_batch_tokens": float(worst[1]),
            "batch/tokens": float(fsdp.all_reduce(sum(lengths)))}


def train_step(step, cfg, actor, critic, ref, opt_a, opt_c, engine, frozen, codec, rank, per_rank,
               device, meter, swe_rows=None):
    times, m = {}, {}
    # (1) rollouts with compaction on this rank's share of tasks
    with timed(times, "rollout"), meter.phase("rollout"):
        envs, task_ids = make_envs(cfg, step, rank, per_rank, swe_rows=swe_rows)
        first = step * cfg.optim.rollouts_per_step + rank * per_rank
        rids = list(range(first, first + per_rank))
        gids = [r // cfg.optim.group_size for r in rids]
        fsdp.release_cached_memory()  # the engine's KV cache wakes into what training cached
        engine.wake_up()
        episodes = run_episodes(engine, codec, envs, rollout_config(cfg), rids, task_ids, gids,
                                summary_engine=frozen, progress=rank == 0)
        engine.sleep()
    kept = trainable_episodes(episodes, cfg.task.keep_env_errors, cfg.algorithm.mask_truncated)
    rows = to_rows([s for e in kept for s in e.segments], cfg.algorithm.summaries)
    group_of = {e.rollout_id: e.group_id for e in kept}
    for r in rows:
        r["group_id"] = group_of[r["rollout_id"]]
    rows = assign_groups(rows)  # the same tokens on every rank, whole groups moved
    # (2) old log-probs and values
    with timed(times, "score"), meter.phase("score"):
        score(actor, critic, rows, cfg, device, ref)
    diff = sum(float(((r["old_logprobs"] - r["sampler_logprobs"]).abs() * r["mask"]).sum()) for r in rows)
    # (3) advantages and returns
    with timed(times, "advantage"):
        adv_sums = advantages(rows, cfg, [r["group_id"] for r in rows]) if rows else {}
        if cfg.algorithm.whiten_advantages:  # every rank, rows or not: the statistics are global
            for r, a in zip(rows, whiten_segments([r["advantages"] for r in rows], [r["mask"] for r in rows])):
                r["advantages"] = a.float()
    adv_sums = {k: float(fsdp.all_reduce(adv_sums.get(k, 0.0))) for k in ("lambda", "correction", "early_tokens")}
    m.update(rollout_metrics(episodes, rows))
    m["adv/lambda"] = adv_sums["lambda"] / max(m["rollout/trainable_tokens"], 1)
    m["adv/correction"] = adv_sums["correction"] / max(adv_sums["early_tokens"], 1)
    m["policy/sampler_logprob_diff"] = float(fsdp.all_reduce(diff)) / max(m["rollout/trainable_tokens"], 1)
    mbs = minibatch_indices(rows, cfg.optim.mini_batches)
    # (4) critic updates (value pre-training: only these for the first steps)
    skipped, crit, crit_steps = 0, [], []
    with timed(times, "critic"), meter.phase("critic"):
        for _ in range(cfg.optim.critic_updates):
            for idx in mbs:
                mb_sums, stats, sk = optimize(critic, opt_c, rows, idx, value_loss_fn(cfg), cfg, device,
                                              ("old_values", "returns"))
                crit.append(mb_sums)
                crit_steps.append(stats)
                skipped += sk
    # (5) PPO policy update, normalized by the global trainable-token count
    pol, pol_steps = [], []
    if step >= cfg.optim.value_pretrain_steps:
        with timed(times, "actor"), meter.phase("actor"):
            for _ in range(cfg.optim.ppo_epochs):
                for idx in mbs:
                    mb_sums, stats, sk = optimize(actor, opt_a, rows, idx, policy_loss_fn(cfg), cfg, device,
                                                  ("old_logprobs", "advantages")
                                                  + (("ref_logprobs",) if ref is not None else ()))
                    pol.append(mb_sums)
                    pol_steps.append(stats)
                    skipped += sk
        # (6) push the new weights to the rollout engine
        with timed(times, "sync"), meter.phase("sync"):
            push_weights(actor, engine, device)
    # (7) metrics
    for prefix, parts, steps in (("value", crit, crit_steps), ("policy", pol, pol_steps)):
        if parts and (reduced := reduce_sums(parts)):   # empty: no rank had a token to train on
            m.update(finalize_metrics(reduced, prefix))
        for k in ("loss", "grad_norm"):
            vals = [s[k] for s in steps if k in s]
            if vals:
                m[f"{prefix}/{k}"] = sum(vals) / len(vals)
    m.update(segment_share_metrics(rows))   # collectives: every rank, with rows or without
    m.update(explained_variance(rows))
    m["train/skipped_steps"] = skipped
    m.update(batch_sizes(rows, mbs, cfg.optim.micro_batch_tokens))
    peak = meter.take()
    worst = fsdp.all_reduce([peak.get(p, -1) for p in memory_plan.PHASES], dist.ReduceOp.MAX)
    m.update({f"memory/{p}": float(v) / 2**30 for p, v in zip(memory_plan.PHASES, worst) if v >= 0})
    m.update(times)
    m["time/step"] = sum(times.values())
    m["time/tokens_per_s"] = m["rollout/sampled_tokens"] / max(times["time/rollout"], 1e-9)
    return m, episodes, rows


def main(cfg):
    rank, world, device = fsdp.init_distributed()
    import transformers
    transformers.utils.logging.disable_progress_bar()
    if cfg.model.plan:
        status = print_plan(cfg, world) if rank == 0 else 0
        fsdp.close_distributed()
        return status
    per_rank = finalize(cfg, world)
    # every check before any model is loaded
    model_path, resume_from, swe_rows, (shapes, setup, phases) = prepare_run(cfg, rank, world, device)
    print0 = print if rank == 0 else (lambda *a, **k: None)
    print0(memory_plan.summary(shapes, setup, phases))
    tokenizer = load_tokenizer(model_path)
    codec = ChatCodec(tokenizer, template_kwargs(cfg))
    fsdp.fail_together(lambda: check_prompts(cfg, codec, swe_rows))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    meter = memory_plan.PeakMeter()  # before the models: on a CPU it measures from here
    torch.manual_seed(cfg.run.seed)  # the same initial weights everywhere (only rank 0's are used)
    actor, critic = make_models(cfg, model_path, device, save_softmax=setup.save_head)
    # the KL reference: a frozen copy of the policy as RL starts (after the warm-up)
    ref = make_models(cfg, model_path, device, actor_only=True).requires_grad_(False) if cfg.algorithm.kl_coef else None
    opt_a, opt_c = adam(actor.parameters(), cfg.optim.actor_lr), adam(critic.parameters(), cfg.optim.critic_lr)
    # CRUCIAL: a different sampling seed per rank, or every rank would sample the same rollouts.
    fsdp.set_rng_state(seeded_rng(cfg.run.seed + rank))
    ckpt_root = os.path.join(cfg.run.out_dir, "checkpoints")
    models = {"actor": actor, "critic": critic, **({"ref": ref} if ref is not None else {})}
    start = 0
    if resume_from:
        extra = fsdp.load_checkpoint(resume_from, models, {"actor": opt_a, "critic": opt_c})
        start = extra["step"] + 1
        fsdp.set_rng_state(extra["rng"])
        print0(f"resumed from {resume_from} at step {start}")
    logger = Logger(cfg.run.out_dir, rank, start, cfg.log.tensorboard, flat(cfg) if cfg.log.wandb else None)
    fraction = memory_plan.engine_fraction(shapes, setup) if setup.gpu and setup.engine == "vllm" else None
    engine = engine_for(cfg, model_path, pad_id, device, fraction)
    if start == 0 and cfg.optim.warmup_steps:
        warmup(actor, cfg, codec, rank, per_rank, device, print0)
        critic_from_policy(critic, actor)
    if start == 0 and ref is not None:
        ref.load_state_dict(actor.state_dict())
    push_weights(actor, engine, device)
    frozen = None  # the frozen-summarizer ablation: the initial policy, never updated
    if cfg.algorithm.summaries == "frozen":
        frozen = engine_for(cfg, model_path, pad_id, device, fraction)
        push_weights(actor, frozen, device)
    print0(f"world {world} · {per_rank} rollouts/rank · model {model_path} · task {cfg.task.name} · "
           f"estimator {cfg.algorithm.estimator} · normalizer {cfg.algorithm.normalizer}")
    from tqdm import tqdm
    # disable=None: a bar on a terminal, none in a log file
    bar = tqdm(range(start, cfg.optim.steps), disable=True if rank != 0 else None, initial=start, total=cfg.optim.steps)
    for step in bar:
        frac = 1.0 - step / cfg.optim.steps if cfg.optim.lr_schedule == "linear" else 1.0
        for opt, lr in ((opt_a, cfg.optim.actor_lr), (opt_c, cfg.optim.critic_lr)):
            for group in opt.param_groups:
                group["lr"] = lr * frac
        metrics, episodes, rows = train_step(step, cfg, actor, critic, ref, opt_a, opt_c, engine, frozen,
                                             codec, rank, per_rank, device, meter, swe_rows)
        logger.log(step, {**metrics, "train/actor_lr": cfg.optim.actor_lr * frac})
        bar.set_postfix(reward=f"{metrics['rollout/reward']:.2f}", comp=f"{metrics['rollout/compactions']:.2f}",
                        s=f"{metrics['time/step']:.1f}")
        if bar.disable and (step % cfg.log.log_every == 0 or step == cfg.optim.steps - 1):
            print0(step_line(step, cfg.optim.steps, metrics), flush=True)  # no bar (a log file): a line
        if step % cfg.log.dump_every == 0 or step == cfg.optim.steps - 1:
            sample = sorted(episodes, key=lambda e: -e.compactions)[:2] + episodes[-1:]
            sample_rows = rows_of(rows, [e.rollout_id for e in sample])
            logger.text(f"samples_step{step:05d}.txt",
                        "\n\n".join(format_episode(e, lambda ids: tokenizer.decode(ids)) for e in sample))
            if rank == 0:
                plot_curve(logger.path, os.path.join(cfg.run.out_dir, "curve.png"))
                # and report.html
                report.dump_step(cfg.run.out_dir, step, sample, sample_rows, tokenizer.decode, cfg.algorithm.gamma)
        if cfg.run.export_every and (step + 1) % cfg.run.export_every == 0:
            export(actor, model_path, tokenizer, os.path.join(cfg.run.out_dir, f"hf_step_{step}"), rank,
                   cfg.model.rope_scaling)
        if (cfg.run.save_every and (step + 1) % cfg.run.save_every == 0) or step == cfg.optim.steps - 1:
            fsdp.save_checkpoint(ckpt_root, step, models, {"actor": opt_a, "critic": opt_c},
                                 {"step": step, "rng": fsdp.rng_state(), "config": flat(cfg)},
                                 keep=cfg.run.keep_checkpoints)
    if cfg.run.export_hf:
        export(actor, model_path, tokenizer, os.path.join(cfg.run.out_dir, "hf"), rank, cfg.model.rope_scaling)
        print0(f"exported the policy to {os.path.join(cfg.run.out_dir, 'hf')}")
    dist.barrier()
    for e in (engine, frozen):
        if e is not None:
            e.close()  # an in-process vLLM engine also destroys the default process group
    fsdp.close_distributed()


def rows_of(rows, rollout_ids):
    """On rank 0, the rows of rank 0's `rollout_ids` (its dumped episodes), on whichever rank
    batch.assign_groups placed them; None on the other ranks. A collective."""
    wanted = [set(rollout_ids)]
    dist.broadcast_object_list(wanted, src=0)
    found = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object([r for r in rows if r["rollout_id"] in wanted[0]], found, dst=0)
    return None if found is None else [r for part in found for r in part]


def seeded_rng(seed):
    import random
    import numpy as np
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    return fsdp.rng_state()


def export(actor, model_path, tokenizer, out_dir, rank, rope_scaling=None):
    """save_pretrained of the current policy (full weights gathered to rank 0), with the config it
    was trained with (rope scaling included)."""
    from transformers import AutoModelForCausalLM
    sd = fsdp.full_state_dict(actor, cpu_offload=True)
    if rank == 0:
        lm = AutoModelForCausalLM.from_config(hf_config(model_path, rope_scaling))
        lm.load_state_dict({k.removeprefix("lm."): v for k, v in sd.items()})
        export_pretrained(lm, tokenizer, out_dir)


if __name__ == "__main__":
    import sys
    sys.exit(main(parse_config()))
