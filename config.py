"""Every knob of train.py, in groups (the CLI is generated from them by tyro, one --help box per
group; flags carry no group prefix), each with its paper value where the paper states one; the
presets (`PRESETS`), whose values every flag overrides; `finalize`, which checks the derived sizes
once; and `RolloutConfig`, the agent loop's limits, shared with eval_swebench.py."""
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Annotated, Literal

import tyro

from compaction import SUMMARY_INSTRUCTION

# The paper's letters for the estimators, and the names flags, config.json and train.py use.
ESTIMATORS = {"P": "cross-trajectory", "E": "concatenated", "N": "per-segment", "G": "group"}

Estimator = Literal["cross-trajectory", "concatenated", "per-segment", "group", "P", "E", "N", "G"]

# Tokens past C + observation + summary that the longest sequence may hold when the tokenizer is
# not at hand: q_sum's message and the chat template's glue.
GLUE_TOKENS = 1024


@dataclass
class RolloutConfig:
    """The agent loop's limits (docs/method.md, 'Rollouts with compaction'): one set of knobs for
    train.py and eval_swebench.py."""
    context_budget: int = 72
    """C, tokens of one context window. Paper: 65536 (30B) / 81920 (106B). The memory default is
    sized so that the task's 6 distractors need one compaction."""
    reserve: int = 16
    """T_comp: compact when C − |h| < reserve (eq. 7). Paper: 10240 (= the response cap)."""
    max_compactions: int = 3
    """K, compactions per rollout (0 = single window). Once K are spent the window runs on until C is
    full, then the episode ends `budget_exhausted`. Paper: 3."""
    max_turns: int = 20
    """Actions per rollout. Paper: 250 (evaluation; training not stated)."""
    max_action_tokens: int = 1
    """Cap on one action (an action cut at the cap is closed with eos, not trained). Paper: 10240.
    The memory default 1: the task's actions are free and its answer is one symbol, so every step
    has the same length whatever the policy writes, and compaction fires at the same step on every
    seed."""
    max_summary_tokens: int = 6
    """Cap on one summary. Paper: 10240."""
    max_observation_tokens: int = 1024
    """Cap on one observation (head and tail kept). Not stated in the paper."""
    max_format_errors: int = 3
    """Consecutive replies without exactly one command that end a rollout (end reason
    format_errors). Not stated in the paper."""
    keep_last: int = 2
    """k, recent atomic steps kept verbatim after compaction (eq. 9). Paper: 2."""
    repeat_task: bool = True
    """Repeat the task text in the resume message. Not stated in the paper; on, so a resumed window
    never depends on the summary to know its task."""
    temperature: float = 1.0
    """Sampling temperature; the trainer divides logits by it too. Paper: 1.0."""
    episode_seconds: Annotated[float, tyro.conf.arg(aliases=("--episode-timeout",))] = 0.0
    """Wall-clock limit of one episode, seconds; 0 = none. An episode past it ends as `timeout`
    (reward 0; in training, still trained unless --mask-truncated). Paper: not stated."""
    env_workers: int = 8
    """Threads (per rank) that start, step, grade and remove environments while the engine generates
    for the other episodes: each episode runs on its own (rollout.run_episodes), so a slow command
    holds up only its own episode, and a finished episode is graded at once. Not a paper setting."""
    summary_instruction: tyro.conf.Suppress[str] = SUMMARY_INSTRUCTION
    """q_sum, the task's (not a flag)."""
    resume_template: tyro.conf.Suppress[str] = ""
    """u_resume with {task} and {summary}, the task's; "" = compaction's default (not a flag)."""


@dataclass
class ModelConfig:
    """The policy model, the rollout engine and the memory plan. Engineering knobs: the paper states
    none of them."""
    path: Annotated[str, tyro.conf.arg(name="model")] = ""
    """Policy checkpoint: Hugging Face id or local path. Empty = build the embedded tiny model."""
    tiny_hidden: int = 128
    """Embedded tiny model (when --model is empty): hidden size."""
    tiny_layers: int = 2
    """Embedded tiny model: decoder layers."""
    tiny_heads: int = 4
    """Embedded tiny model: attention heads (head_dim is 32, what vLLM's CPU backend accepts)."""
    rope_scaling: tuple[float, int] | None = None
    """YaRN RoPE scaling as FACTOR ORIGINAL (original = the positions the model was trained on):
    positions up to FACTOR × ORIGINAL. Passed identically to the trainer's model config and to
    vLLM, so both compute the same positions. Qwen3's documented long-context setting: 4 32768.
    None: the checkpoint's own positions. The longest sequence must fit (checked at start)."""
    thinking: bool = True
    """Render the chat template with enable_thinking (Qwen3, GLM-4.5): --no-thinking gives every
    turn the template's empty reasoning block, so the policy answers directly. Templates without
    the switch ignore it. The environment reads commands from the answer after any reasoning."""
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine; auto = vllm when installed and a GPU is present, else hf."""
    kv_cache_gib: float = 0.25
    """vLLM KV-cache budget per rank, GiB: a fixed size, not a fraction of free memory, because the
    trainer shares the device. Must hold one max_model_len sequence; more = more rollouts at once."""
    mixed_precision: bool = True
    """bf16 params with fp32 reduction on GPU (ignored on CPU)."""
    activation_checkpointing: bool = False
    """Recompute decoder-layer activations in backward: a layer keeps only its input (T·H values)
    instead of everything autograd saves (memory_plan.py), for a second forward's compute."""
    cpu_offload: bool = False
    """FSDP2 CPU offload: the sharded fp32 parameters, gradients and Adam moments of actor and
    critic live in host memory and the optimizer steps there; the device holds the gathered layers
    and the activations. For a model whose states do not fit beside the engine; slower updates."""
    plan: bool = False
    """Print the memory plan of this configuration (per rank: every component in every phase of a
    step) and exit, loading no model: status 0 when it fits, 1 naming the flags that would make it
    fit. Every run checks the same plan before loading a model."""
    plan_world: int = 0
    """--plan for this many ranks (0 = the world size launched)."""
    plan_device: Literal["auto", "cuda", "cpu"] = "auto"
    """--plan for this kind of device (auto = the one here)."""
    device_memory_gib: float = 0.0
    """Memory of one rank's device, GiB, that the plan must fit. 0 = the GPU's own total, or on a
    CPU the host's shared by the ranks of this machine. Set it to plan for a device not here."""


@dataclass
class TaskConfig:
    """The task and its environments. The paper's task is SWE (--preset swe-paper); the memory task
    is this project's CPU demo, and the sandbox knobs are not stated in the paper."""
    name: Annotated[Literal["memory", "swe"], tyro.conf.arg(name="task")] = "memory"
    """memory: the built-in CPU task (memory_task.py); swe: SWE task rows from `tasks`."""
    tasks: str = ""
    """--task swe: the task rows (swe_task.load_tasks, as eval_swebench.py reads them): a Hugging Face
    dataset id or folder (e.g. SWE-bench/SWE-bench_Verified) or a .jsonl/.json/.parquet file in
    SWE-bench's schema. Empty = the built-in tasks (tasks/swe/tasks.jsonl)."""
    tasks_split: str = "test"
    """Split of a Hugging Face dataset in `tasks`."""
    sandbox: Literal["local", "docker"] = "local"
    """Where SWE commands run: local (bubblewrap, rows with a repo_dir, such as the built-in ones) or
    docker (each row's image: SWE-bench's, or the built-in tasks' from tasks/swe/build_images.py)."""
    command_timeout: float = 60.0
    """Seconds one agent command may run (mini-swe-agent's SWE-bench setting). Paper: not stated."""
    eval_timeout: float = 1800.0
    """Seconds the reward's tests may run: the official harness's --timeout default. Paper: not stated."""
    pull_images: bool = False
    """--sandbox docker: pull the task images that are not present before training starts. Off: a
    missing image stops the run at start, named."""
    allow_unisolated: bool = False
    """Run local agent commands as plain processes when bubblewrap cannot isolate them. Off: such a
    run stops before loading any model, naming the fix (`apt-get install bubblewrap`)."""
    keep_env_errors: bool = False
    """Train on episodes that ended in env_error (a sandbox or grader failure: not the policy's
    doing). Off: they are left out of the batch, and counted in end/env_error."""
    memory_keys: int = 4
    """Memory task: number of possible keys (chance success = 1/memory_keys)."""
    memory_noise: int = 6
    """Memory task: distractor steps between the key and the question."""
    memory_p_short: float = 0.25
    """Memory task: fraction of short RL episodes (question before any compaction). They keep the
    answer-from-context skill rewarded; only the compacted episodes measure summary learning."""
    memory_filler: int = 0
    """Memory task: words of padding after every observation line. Windows then grow by what the
    environment returns, as an agent's do, so a long-context check needs few sampled tokens."""
    memory_max_key_at: int = 2
    """Memory task: at most this many distractors come before the key in RL episodes."""


@dataclass
class AlgorithmConfig:
    """Advantages, returns and losses (docs/method.md, 'Advantages' and 'Losses')."""
    estimator: Estimator = "cross-trajectory"
    """cross-trajectory: per-window GAE with the eq.-14 correction (the paper's estimator, its P);
    concatenated: one GAE over the rollout's windows end to end (E); per-segment: naive GAE per
    window, each ending in R (N); group: group-relative R − mean of the task's group (G). The
    paper's letters are accepted and read as the names (ESTIMATORS)."""
    gamma: float = 1.0
    """γ. Not stated in the paper; 1 (the only reward is at the end of the rollout)."""
    lam_mode: Literal["rollout", "segment", "fixed"] = "rollout"
    """λ = 1 − 1/(α·l) with l = the rollout's trainable tokens (default) or the segment's; or `lam`.
    The paper does not state which length l is: rollout is this project's reading (every segment
    of a rollout then shares one λ, as one GAE over the rollout would)."""
    lam: float = 0.95
    """λ when lam_mode = fixed. Not a paper setting (the paper's λ is adaptive)."""
    lam_alpha: float = 1.5
    """α of the adaptive λ. Paper: 1.5."""
    critic_target: Literal["local", "mc"] = "local"
    """local: G = A_loc + V, the local GAE's return (never the corrected Â + V); mc: G = R on every
    token. Not stated in the paper."""
    normalizer: Literal["token", "segment", "rollout"] = "token"
    """Loss normalization: token = global trainable-token mean (paper eq. 12)."""
    whiten_advantages: bool = False
    """Mask-aware advantage whitening with the statistics of every rank's trainable tokens. Not
    stated in the paper (off here: R is already in [0, 1])."""
    clip_low: float = 0.2
    """ε_low. Not stated in the paper."""
    clip_high: float = 0.28
    """ε_high (clip-higher, as DAPO). Not stated in the paper."""
    dual_clip: float = 0.0
    """Dual-clip constant c for Â < 0; 0 = off. Not stated in the paper."""
    value_clip: float = 0.2
    """ε_v for the clipped value loss; 0 = off. Not stated in the paper."""
    kl_coef: float = 0.0
    """β of a KL(π_θ ‖ π_ref) penalty (k3 estimator per token) to the policy after the warm-up.
    Paper: 0 (no KL)."""
    entropy_coef: float = 0.0
    """Entropy bonus. Not stated in the paper (0 here: over the tiny model's byte-level vocabulary a
    bonus wrecks the output format)."""
    summaries: Literal["trained", "masked", "frozen"] = "trained"
    """trained: summary tokens are in the loss (paper); masked: they are not (the paper's
    'w/o summary training'); frozen: a frozen copy of the initial policy writes them."""
    mask_truncated: bool = False
    """SUPO-style overlong masking: no loss on rollouts that ran out of budget. Paper: off."""

    def __post_init__(self):  # a paper letter is read as its name, however the config is built
        self.estimator = ESTIMATORS.get(self.estimator, self.estimator)


@dataclass
class OptimConfig:
    """Steps, batch sizes, learning rates, and the supervised warm-up."""
    steps: int = 50
    """Training steps (each: rollouts, critic updates and, after the first value_pretrain_steps, one
    policy update). Must exceed value_pretrain_steps, or 0 (the warm-up alone). Not stated in the
    paper."""
    rollouts_per_step: int = 128
    """Global rollouts per step, split over ranks. Paper: 128 (group size 1)."""
    group_size: int = 1
    """Rollouts per task (estimator G needs > 1). Paper: 1."""
    mini_batches: int = 4
    """Optimizer steps per PPO epoch; rollouts are split into this many mini-batches, each with its
    own token normalizer Z. Paper: 1 (one policy update per step). The CPU default takes 4 smaller
    steps, which the tiny model needs to learn in minutes."""
    ppo_epochs: int = 1
    """Passes over the batch per policy update. Paper: 1 (one policy update per step)."""
    micro_batch_tokens: int = 16384
    """Tokens per forward/backward: windows packed into one row, without padding, up to this many
    (a longer window runs alone). A memory knob, not a math knob (the loss is the same whatever it
    is), so no paper value."""
    actor_lr: float = 1e-3
    """Actor Adam lr. Paper: 2e-6."""
    critic_lr: float = 3e-3
    """Critic Adam lr. Paper: 3e-6."""
    lr_schedule: Literal["linear", "constant"] = "linear"
    """Both lrs decay linearly to 0 over `steps` (as CleanRL's PPO does), or stay constant. Paper:
    constant (the swe-paper preset). The tiny model's lr of 1e-3 needs the decay: held constant it
    destabilizes the policy once it has learned."""
    grad_clip: float = 1.0
    """Max global grad norm. Not stated in the paper."""
    critic_updates: int = 1
    """Critic updates per step (passes over the batch). Paper: 2. The CPU default is 1: each pass
    costs as much as the policy's, and with 1 the memory task still learns (the default run's curve)."""
    value_pretrain_steps: int = 3
    """Critic-only steps at the start, on rollouts of the initial policy. Paper: 50."""
    warmup_steps: int = 150
    """Supervised warm-up steps before RL (memory task only; 0 = off): the turn format, answering
    with the key in context, summaries that copy a random line (memory_task.WarmupDemoEngine).
    Not in the paper (which starts RL from a trained model): the CPU demo's."""
    warmup_p_short: float = 0.5
    """Fraction of short episodes in the warm-up. Not in the paper."""
    warmup_max_key_at: int = 2
    """At most this many distractors before the key in warm-up episodes: a varying position makes
    the answer skill read the key by content, so it also reads a summary. Not in the paper."""
    warmup_lr: float = 3e-3
    """Adam lr of the warm-up. Not in the paper."""


@dataclass
class RunConfig:
    """The run's folder, seed, checkpoints and exports (no paper values)."""
    seed: int = 0
    """Seed of weights and tasks; sampling seeds are seed + rank."""
    out_dir: str = "runs/default"
    """Metrics (metrics.jsonl, curve.png), trajectory dumps, report.html, checkpoints, the HF export."""
    resume: bool = False
    """Continue from the newest valid checkpoint in out_dir/checkpoints (one whose files match its
    manifest; a damaged newer one is skipped with a warning). No valid checkpoint is an error."""
    overwrite: bool = False
    """Replace the run in out_dir: remove what train.py wrote there (rundir.RUN_ARTIFACTS), keep
    other files. Without it (or --resume) an out_dir that holds a run is refused."""
    save_every: int = 20
    """Checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept."""
    export_hf: bool = True
    """save_pretrained the policy at the end (out_dir/hf)."""
    export_every: int = 0
    """Also export every N steps, to out_dir/hf_step_N (0 = never)."""


@dataclass
class LogConfig:
    """What a run prints and writes as it goes (no paper values)."""
    log_every: int = 1
    """Every N steps (and at the last), one line to stdout (step, reward, success given compaction,
    compactions, s/step, tokens/s) when stdout is not a terminal; a terminal shows a progress bar."""
    dump_every: int = 10
    """Every N steps (and at the last), dump sample trajectories (samples_step*.txt, episodes_step*.jsonl)
    and rebuild report.html."""
    tensorboard: bool = False
    """Also log to TensorBoard (out_dir/tb; needs `pip install tensorboard`)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""


@dataclass
class Config:
    preset: Literal["memory", "swe", "swe-paper"] = "memory"
    """The defaults the other flags override (`PRESETS`, listed by --help). Given only --task swe,
    the preset is swe."""
    model: tyro.conf.OmitArgPrefixes[ModelConfig] = field(default_factory=ModelConfig)
    task: tyro.conf.OmitArgPrefixes[TaskConfig] = field(default_factory=TaskConfig)
    rollout: tyro.conf.OmitArgPrefixes[RolloutConfig] = field(default_factory=RolloutConfig)
    algorithm: tyro.conf.OmitArgPrefixes[AlgorithmConfig] = field(default_factory=AlgorithmConfig)
    optim: Annotated[tyro.conf.OmitArgPrefixes[OptimConfig], tyro.conf.arg(name="optimization")] = \
        field(default_factory=OptimConfig)  # the name titles its --help box
    run: tyro.conf.OmitArgPrefixes[RunConfig] = field(default_factory=RunConfig)
    log: Annotated[tyro.conf.OmitArgPrefixes[LogConfig], tyro.conf.arg(name="logging")] = \
        field(default_factory=LogConfig)


# Fields whose flag has another name (cfg.model.path is --model, cfg.task.name is --task), and the
# task's own texts, which are not flags.
RENAMED = {"path": "model", "name": "task"}
NOT_FLAGS = ("summary_instruction", "resume_template")


def flag_names(group):
    """{knob name as its flag spells it, with _: field name} of one group dataclass."""
    return {RENAMED.get(f.name, f.name): f.name for f in fields(group) if f.name not in NOT_FLAGS}


def flat(cfg):
    """{flag name: value} of every knob of a Config (the names as the flags spell them, with _),
    as config.json holds them."""
    out = {"preset": cfg.preset}
    for g in fields(Config):
        if g.name != "preset":
            group = getattr(cfg, g.name)
            out.update({name: getattr(group, attr) for name, attr in flag_names(type(group)).items()})
    return out


def override(cfg, **values):
    """`cfg` with knobs set by their flag names (as flat() names them): the presets' and tests'
    way to say `context_budget=2048` without naming the group."""
    groups = {g.name: getattr(cfg, g.name) for g in fields(Config) if g.name != "preset"}
    changes = {g: {} for g in groups}
    for name, value in values.items():
        if name == "preset":
            continue
        owner = [g for g, group in groups.items() if name in flag_names(type(group))]
        if not owner:
            raise TypeError(f"no knob named {name!r}")
        changes[owner[0]][flag_names(type(groups[owner[0]]))[name]] = value
    new = {g: replace(group, **changes[g]) for g, group in groups.items()}
    return replace(cfg, preset=values.get("preset", cfg.preset), **new)


def make(**values):
    """A Config: the memory defaults with knobs set by their flag names (override)."""
    return override(Config(), **values)


PRESETS = {
    "memory": ("the default run: the built-in memory task on CPU (README, 'What the default run learns')",
               make()),
    "swe": ("the built-in SWE tasks on CPU with the tiny model: a window that holds an issue with room "
            "for actions of up to 512 tokens (a whole patch); no warm-up",
            make(preset="swe", task="swe", context_budget=2048, reserve=512, max_action_tokens=512,
                 max_summary_tokens=256, max_observation_tokens=512, max_turns=8, steps=20,
                 rollouts_per_step=8, mini_batches=2, value_pretrain_steps=1, warmup_steps=0)),
    "swe-paper": ("the paper's SWE settings (Docker sandboxes, C 65536, T_comp 10240, K 3, 128 rollouts, "
                  "constant lrs 2e-6/3e-6, one policy update per step, 2 critic updates, 50 value pre-training "
                  "steps, 300 steps) on GPUs with vLLM, sized by the memory plan for 8B on 80 GB (activation "
                  "checkpointing, optimizer states offloaded to the CPU, a 40 GiB KV cache); give --model, "
                  "--tasks and, for a model whose positions end before the longest window, --rope-scaling",
                  make(preset="swe-paper", task="swe", sandbox="docker", context_budget=65536,
                       reserve=10240, max_action_tokens=10240, max_summary_tokens=10240, max_compactions=3,
                       max_turns=250, rollouts_per_step=128, group_size=1, mini_batches=1, ppo_epochs=1,
                       actor_lr=2e-6, critic_lr=3e-6, critic_updates=2, value_pretrain_steps=50, steps=300,
                       lr_schedule="constant", warmup_steps=0, entropy_coef=0.0, kl_coef=0.0, engine="vllm",
                       activation_checkpointing=True, cpu_offload=True, kv_cache_gib=40.0)),
}
"""name: (what it is for, its Config). Flags given with a preset override its values."""


def preset_help():
    """The presets and how each differs from the memory defaults, for --help."""
    base_values, lines = flat(PRESETS["memory"][1]), ["Presets (--preset NAME; --task swe alone means --preset swe):"]
    for name, (what, cfg) in PRESETS.items():
        changed = [flag_text(key, value) for key, value in flat(cfg).items()
                   if key != "preset" and value != base_values[key]]
        lines.append(f"  {name}: {what}." + (f" Sets {' '.join(changed)}." if changed else ""))
    return "\n".join(lines)


def flag_text(name, value):
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def flag_value(argv, flag):
    """The value given to `flag` in argv (`--flag value` or `--flag=value`), or None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def parse_config(argv=None):
    """The Config of a command line: the preset's values (--preset, or swe for --task swe alone),
    overridden by every flag given."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = flag_value(argv, "--preset") or ("swe" if flag_value(argv, "--task") == "swe" else "memory")
    default = PRESETS.get(name, PRESETS["memory"])[1]   # an unknown name: tyro names the choices
    return tyro.cli(Config, args=argv, default=replace(default), description=preset_help())


def max_model_len(r, glue=GLUE_TOKENS):
    """The longest sequence of an episode under RolloutConfig `r`: a window may pass C by one capped
    observation before the trigger fires (eq. 7 is checked after each step), then q_sum's message
    and the summary follow. `glue`: the tokens of q_sum's message and the generation prompt, exact
    when the tokenizer is at hand (rollout.run_episodes), else a bound."""
    return r.context_budget + r.max_observation_tokens + r.max_summary_tokens + glue


def check_rollout(r):
    """The loop's limits make sense together (train.py and eval_swebench.py both check them)."""
    assert 0 <= r.reserve < r.context_budget, "need 0 <= reserve < context_budget (eq. 7)"
    assert r.max_action_tokens <= r.reserve, \
        "max_action_tokens must fit in the reserve that eq. 7 keeps free (a response always fits)"
    assert r.max_compactions >= 0 and r.max_turns >= 1 and r.keep_last >= 0, \
        "need max_compactions >= 0, max_turns >= 1, keep_last >= 0"
    assert r.max_action_tokens >= 1 and r.max_summary_tokens >= 1, "need max_action_tokens, max_summary_tokens >= 1"
    assert r.env_workers >= 1 and r.episode_seconds >= 0, "need env_workers >= 1 and episode_seconds >= 0"


def finalize(cfg, world):
    """Derived sizes, checked once. Returns rollouts per rank."""
    o, a, t = cfg.optim, cfg.algorithm, cfg.task
    check_rollout(cfg.rollout)
    assert o.rollouts_per_step % world == 0, \
        f"rollouts_per_step ({o.rollouts_per_step}) must be divisible by the world size ({world})"
    per_rank = o.rollouts_per_step // world
    assert per_rank % o.group_size == 0, \
        f"rollouts per rank ({per_rank}) must be a multiple of group_size ({o.group_size}): groups stay on one rank"
    assert a.estimator != "group" or o.group_size > 1, "the group estimator (G) needs group_size > 1"
    assert t.name == PRESETS[cfg.preset][1].task.name, \
        f"--preset {cfg.preset} is for --task {PRESETS[cfg.preset][1].task.name}, not --task {t.name}"
    assert o.warmup_steps == 0 or t.name == "memory", \
        "the warm-up exists for the memory task only: --task swe needs --warmup-steps 0 (as --preset swe sets)"
    assert cfg.model.path or cfg.preset != "swe-paper", \
        "--preset swe-paper trains a real policy: give --model (a Hugging Face id or local checkpoint)"
    assert t.command_timeout > 0 and t.eval_timeout > 0, "command_timeout and eval_timeout must be positive"
    assert not (cfg.run.resume and cfg.run.overwrite), "--resume continues the run in out_dir, --overwrite replaces it"
    assert o.steps == 0 or o.steps > o.value_pretrain_steps, \
        (f"--steps {o.steps} with --value-pretrain-steps {o.value_pretrain_steps}: steps 0 to "
         f"{o.value_pretrain_steps - 1} train only the critic, so the policy would never be updated; raise "
         f"--steps or lower --value-pretrain-steps")
    return per_rank
