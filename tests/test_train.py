"""train.py end to end: one process and `torchrun --nproc_per_node=2` (gloo); 1 rank vs 2 ranks
on the same global batch; the optimized loss is the global token mean; resume is exact.

Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_train.py   (about 2 minutes on 2 cores)
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import batch
import report
import train
from advantage import cross_trajectory_gae, rollout_lengths
from loss import ppo_policy_loss
from metrics import read_metrics
from model import build_tiny_model, load_policy, load_tokenizer, token_logprobs
from config import PRESETS, finalize, flat, make, override, parse_config
from conftest import bwrap_isolates, require_docker_images
from model import ChatCodec
from rollout import run_episodes
from sandbox import RUN_ID, RUN_LABEL, DockerSandbox, SandboxError
from scripted import ScriptedAgent, gold_script, submit_script
from swe_task import load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--rollouts-per-step", "8", "--warmup-steps", "2", "--value-pretrain-steps", "1",
         "--mini-batches", "2", "--micro-batch-tokens", "2048"]


def run(args, nproc=None, timeout=600):
    launcher = [sys.executable] if nproc is None else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    p = subprocess.run(launcher + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return p


def metrics(out):
    return read_metrics(os.path.join(out, "metrics.jsonl"))


@pytest.mark.parametrize("nproc", [None, 2])
def test_end_to_end(tmp_path, nproc):
    out = str(tmp_path / "run")
    extra = ["--activation-checkpointing"] if nproc else []
    p = run(["train.py", "--steps", "2", "--out-dir", out, "--save-every", "1", "--keep-checkpoints", "1",
             "--dump-every", "1"] + SMALL + extra, nproc)
    recs = metrics(out)
    # stdout is a pipe here, as in a log file: no bar, one line per step
    assert [line.split(" · ")[0] for line in p.stdout.splitlines() if line.startswith("step ")] == \
        ["step 1/2", "step 2/2"]
    assert [r["step"] for r in recs] == [0, 1]
    for key in ("rollout/reward", "rollout/compactions", "rollout/summary_tokens", "rollout/truncation_rate",
                "rollout/success_given_compaction", "rollout/trainable_tokens", "value/explained_variance",
                "time/rollout", "time/tokens_per_s", "adv/share_seg0", "adv/correction"):
        assert key in recs[-1], key
    assert "policy/clipfrac" in recs[1] and "policy/approx_kl" in recs[1]  # step 1: first policy update
    assert "policy/clipfrac" not in recs[0]  # step 0: value pre-training only
    lr = train.Config().optim.actor_lr
    assert [r["train/actor_lr"] for r in recs] == [lr, lr / 2]  # linear decay to 0 over --steps 2
    assert recs[1]["policy/sampler_logprob_diff"] < 1e-4  # the trainer sees what the sampler saw
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_00000001"]  # keep = 1
    with open(os.path.join(out, "checkpoints", "step_00000001", "manifest.json")) as f:
        hashed = json.load(f)["files"]  # every rank's files, hashed across the ranks
    assert {f"extra_rank{r}.pt" for r in range(nproc or 1)} | {".metadata"} <= set(hashed)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == {**flat(train.Config()), "steps": 2, "out_dir": out, "save_every": 1,
                                "keep_checkpoints": 1, "dump_every": 1, "rollouts_per_step": 8,
                                "warmup_steps": 2, "value_pretrain_steps": 1, "mini_batches": 2,
                                "micro_batch_tokens": 2048, "activation_checkpointing": bool(nproc)}
    assert os.path.exists(os.path.join(out, "curve.png"))
    assert "TRAIN action" in open(os.path.join(out, "samples_step00001.txt")).read()
    # rank 0's sample, structured (tests/test_report.py checks its contents), and the run's page
    dumped = report.read_records(os.path.join(out, "episodes_step00001.jsonl"))
    assert len(dumped) == 3 and all(w["values"] for r in dumped for w in r["windows"])
    assert [d["label"] for d in report.read_page(os.path.join(out, "report.html"))["runs"][0]["dumps"]] == \
        ["step 0", "step 1"]
    load_policy(os.path.join(out, "hf"))  # the export loads in transformers


def test_logged_lambda_and_correction_match_a_loop():
    """adv/lambda and adv/correction sums: rollout 0 has windows of 3 and 2 trainable tokens,
    rollout 1 one window of 4; only rollout 0's first window has a later one (N_after = 2)."""
    def row(mask, rid, seg):
        mask = torch.tensor(mask, dtype=torch.float32)
        return {"mask": mask, "old_values": torch.zeros_like(mask), "reward": 1.0, "rollout_id": rid,
                "segment_index": seg}
    masks = [([0, 1, 1, 1], 0, 0), ([0, 0, 1, 1], 0, 1), ([1, 1, 1, 1, 0], 1, 0)]
    fixed = train.advantages([row(*m) for m in masks], make(lam_mode="fixed", lam=0.9, gamma=0.99),
                             [0, 0, 1])
    assert fixed["lambda"] == pytest.approx(0.9 * 9)
    assert fixed["early_tokens"] == 3 and fixed["correction"] == pytest.approx(3 * (0.99 * 0.9) ** 2)
    adaptive = train.advantages([row(*m) for m in masks], train.Config(), [0, 0, 1])  # λ = 1 − 1/(1.5·T)
    lam0, lam1 = 1 - 1 / (1.5 * 5), 1 - 1 / (1.5 * 4)
    assert adaptive["lambda"] == pytest.approx(5 * lam0 + 4 * lam1)
    assert adaptive["correction"] == pytest.approx(3 * lam0 ** 2)


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """tests/dist_check.py with 1 and 2 ranks on one tiny model: {n ranks: its results}, and the model."""
    tmp = tmp_path_factory.mktemp("dist")
    model = str(tmp / "model")
    build_tiny_model(model, train.tiny_corpus())
    res = {}
    for n in (1, 2):
        run(["tests/dist_check.py", str(tmp / f"out{n}.pt"), model], nproc=n)
        res[n] = torch.load(tmp / f"out{n}.pt")
    return res, model


def test_activation_checkpointing_runs_on_every_rank(dist_runs):
    """Each decoder layer runs twice per forward and backward (forward, then the recompute), on
    rank 0 too, whose weights come from from_pretrained, and in a world of one."""
    res, _ = dist_runs
    for n in (1, 2):
        for rank, models in enumerate(res[n]["checkpointed_calls"]):
            for name, seen in models.items():
                assert seen["training"], (n, rank, name)
                assert seen["calls"] == 2 * seen["layers"], (n, rank, name, seen)


def test_the_weight_push_streams_tensors_in_the_engines_dtype(dist_runs):
    """train.push_weights hands the engine one gathered tensor at a time, already in its dtype
    (bfloat16 here), the full weights and every name; the trainer's cached memory is released
    before the engine wakes for them."""
    res, _ = dist_runs
    for n in (1, 2):
        for rank, seen in enumerate(res[n]["push"]):
            assert seen["dtypes"] == ["torch.bfloat16"], (n, rank, seen)
            assert seen["most_alive"] == 1, (n, rank, seen)
            assert seen["equal"] and seen["names"] and seen["released_first"], (n, rank, seen)


def test_rows_are_spread_over_ranks_by_tokens_with_whole_rollouts(dist_runs):
    """batch.assign_groups: every rollout lands whole on one rank, and the ranks' token loads
    differ by at most the largest rollout (largest-first placement)."""
    res, _ = dist_runs
    one, (a, b) = res[1]["assigned"][0], res[2]["assigned"]
    assert not set(a) & set(b) and {**a, **b} == one
    assert abs(sum(a.values()) - sum(b.values())) <= max(one.values())


def test_one_rank_equals_two_ranks_and_loss_is_the_global_token_mean(dist_runs):
    res, model = dist_runs
    for n in (1, 2):  # a NaN in the loss skips the step on every rank, weights untouched
        assert res[n]["nan_step_skipped"] == 1 and res[n]["nan_step_unchanged"]
    for part in ("actor", "critic"):
        for k, v in res[1][part].items():
            torch.testing.assert_close(res[2][part][k], v, atol=2e-6, rtol=1e-5, msg=f"{part} {k}")
    # the gradient FSDP produced = the gradient of (1/Z) Σ PPO loss over the whole batch, one pass
    from tests.dist_check import fixed_segments
    tok = load_tokenizer(model)
    rows = batch.to_rows(fixed_segments(len(tok)), "trained")
    mask = batch.pad([r["mask"] for r in rows]).double()
    rid = torch.tensor([r["rollout_id"] for r in rows])
    n_after, _ = rollout_lengths(mask, rid, torch.tensor([r["segment_index"] for r in rows]))
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float64)
    adv, _ = cross_trajectory_gae(torch.zeros_like(mask), mask, rewards, n_after, 1.0, 0.9)  # V ≡ 0 at init
    lm = load_policy(model)
    ids = batch.pad([r["ids"] for r in rows], tok.pad_token_id)
    attn = batch.pad([torch.ones(len(r["ids"]), dtype=torch.long) for r in rows])
    lp, _ = token_logprobs(lm, ids, ids[:, 1:], attention_mask=attn)
    loss, _ = ppo_policy_loss(lp, lp.detach(), adv.float(), mask.float())
    (loss / mask.sum()).backward()
    for name, p in lm.named_parameters():
        for n in (1, 2):
            torch.testing.assert_close(res[n]["grads"][f"lm.{name}"], p.grad, atol=1e-6, rtol=1e-4,
                                       msg=f"{n} ranks: {name}")


def test_adam_is_fused_where_torch_has_it_and_steps_like_the_for_each_one():
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
    twins = [p.detach().clone().requires_grad_() for p in params]
    fused, plain = train.adam(params, 1e-2), torch.optim.Adam(twins, lr=1e-2, foreach=False)
    assert fused.defaults["fused"]
    for _ in range(3):
        for ps, opt in ((params, fused), (twins, plain)):
            opt.zero_grad()
            sum((p ** 2).sum() for p in ps).backward()
            opt.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_resume_is_exact(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    # stopping is simulated by a shorter --steps, so the lr must not depend on --steps here
    common = SMALL + ["--save-every", "0", "--lr-schedule", "constant"]
    run(["train.py", "--steps", "4", "--out-dir", straight] + common)
    run(["train.py", "--steps", "2", "--out-dir", split] + common)
    run(["train.py", "--steps", "4", "--out-dir", split, "--resume"] + common)
    a, b = load_policy(os.path.join(straight, "hf")), load_policy(os.path.join(split, "hf"))
    for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(v, w, atol=0, rtol=0, msg=k)
    ra, rb = metrics(straight), metrics(split)
    assert [r["step"] for r in rb] == [0, 1, 2, 3]
    for x, y in zip(ra, rb):
        assert x["rollout/reward"] == y["rollout/reward"] and x["rollout/turns"] == y["rollout/turns"]


def test_logger_drops_the_steps_a_resumed_run_redoes(tmp_path):
    from metrics import Logger
    log = Logger(str(tmp_path), rank=0, start=0)
    for step in range(4):
        log.log(step, {"rollout/reward": step / 4})
    path = str(tmp_path / "metrics.jsonl")
    Logger(str(tmp_path), rank=0, start=2).log(2, {"rollout/reward": 1.0})  # resumed from the step-1 checkpoint
    assert [(r["step"], r["rollout/reward"]) for r in read_metrics(path)] == [(0, 0.0), (1, 0.25), (2, 1.0)]
    Logger(str(tmp_path), rank=0, start=0)  # a fresh run starts an empty file
    assert read_metrics(path) == []


def test_env_error_episodes_stay_out_of_the_batch_unless_asked():
    from rollout import Episode, Segment
    def episode(end, tokens=2):
        seg = Segment(prompt_ids=[1, 2])
        seg.append([3] * tokens, "action", [-0.1] * tokens)
        return Episode(0, "t", 0, segments=[seg], end_reason=end)
    eps = [episode("submitted"), episode("env_error"), episode("budget_exhausted"), episode("max_turns", 0),
           Episode(1, "t", 1, end_reason="env_error")]   # a sandbox that never started: no window
    assert train.trainable_episodes(eps) == eps[:1] + eps[2:3]
    assert train.trainable_episodes(eps, keep_env_errors=True) == eps[:3]
    assert train.trainable_episodes(eps, mask_truncated=True) == eps[:1]


def test_swe_task_refuses_unisolated_agent_commands_before_any_model(monkeypatch):
    monkeypatch.setattr("sandbox.shutil.which", lambda name: None)   # as on a machine without bubblewrap
    swe = parse_config(["--task", "swe"])
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        train.check_inputs(swe)
    assert len(train.check_inputs(override(swe, allow_unisolated=True))) == 4   # asked for: no check


# --- SWE: presets, task rows, Docker ----------------------------------------------------------------

def test_task_swe_alone_picks_the_swe_preset_and_flags_override_presets():
    swe = parse_config(["--task", "swe"])
    assert swe == replace(PRESETS["swe"][1]) and swe.preset == "swe" and swe.optim.warmup_steps == 0
    assert swe.rollout.max_action_tokens > 1 and swe.rollout.context_budget > 1024   # an issue and a patch fit
    assert parse_config([]) == train.Config() and parse_config(["--task=swe"]) == swe
    paper = parse_config(["--preset", "swe-paper", "--model", "m", "--max-turns", "7"])
    r, o = paper.rollout, paper.optim
    assert (r.context_budget, r.reserve, r.max_compactions, o.rollouts_per_step) == (65536, 10240, 3, 128)
    assert (o.actor_lr, o.critic_lr, o.critic_updates, o.value_pretrain_steps) == (2e-6, 3e-6, 2, 50)
    assert paper.task.sandbox == "docker" and paper.rollout.max_turns == 7 and paper.model.path == "m"
    for argv, problem in ((["--preset", "swe", "--task", "memory"], "--preset swe is for --task swe"),
                          (["--preset", "swe-paper"], "give --model"),
                          (["--task", "swe", "--warmup-steps", "5"], "--warmup-steps 0")):
        with pytest.raises(AssertionError, match=problem):
            finalize(parse_config(argv), 1)
    usage = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert usage.returncode == 0 and all(f"  {name}: " in usage.stdout for name in PRESETS), usage.stdout
    groups = ("model", "task", "rollout", "algorithm", "optimization", "run", "logging")
    assert all(f"─ {g} options ─" in usage.stdout for g in groups), usage.stdout  # one --help box per group
    shown = subprocess.run([sys.executable, "train.py", "--task", "swe", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "COLUMNS": "200"}).stdout
    assert "(default: 2048)" in shown   # --help shows the preset's values as the defaults


def test_docker_sandbox_needs_a_daemon_and_every_task_image_before_any_model(tmp_path):
    """SWE-bench-style rows name published images that are not here: refused at start, naming one
    and how to get it (or, without a daemon, naming that)."""
    row = {k: v for k, v in load_tasks()[0].items() if k not in ("repo_dir", "image")}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(dict(row, instance_id="acme__widgets-1")) + "\n")
    with pytest.raises(SandboxError, match="(1 of 1 task images are not present locally .*docker pull "
                                           "swebench/sweb.eval.x86_64.acme_1776_widgets-1:latest)|needs a Docker daemon"):
        train.check_inputs(parse_config(["--task", "swe", "--sandbox", "docker", "--tasks", str(rows)]))


@pytest.fixture(scope="module")
def tiny_codec(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    build_tiny_model(path, train.tiny_corpus())
    tok = load_tokenizer(path)
    return tok, ChatCodec(tok)


def most_at_once(spans):
    """The largest number of (start, end) spans open at one time."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = [0]
    for _, change in events:
        running.append(running[-1] + change)
    return max(running)


@pytest.mark.parametrize("script,reward", [(gold_script, 1.0), (submit_script, 0.0)], ids=["gold", "empty"])
def test_training_rewards_in_docker_are_the_harness_grades(tiny_codec, script, reward, monkeypatch):
    """Training's own environments (make_envs, --task swe --sandbox docker) on every built-in task,
    each in its locally built image: the agent that applies the gold patch earns 1 on every task,
    the one that submits an empty patch 0. Containers start and are removed concurrently (env
    threads), and none is left."""
    rows = load_tasks()
    require_docker_images([r["image"] for r in rows])
    spans = {"start": [], "remove": []}

    class TimedSandbox(DockerSandbox):
        def __init__(self, *args, **kwargs):
            t = time.monotonic()
            super().__init__(*args, **kwargs)
            spans["start"].append((t, time.monotonic()))

        def close(self):
            t = time.monotonic()
            super().close()
            spans["remove"].append((t, time.monotonic()))

    monkeypatch.setattr("swe_task.DockerSandbox", TimedSandbox)
    tok, codec = tiny_codec
    cfg = parse_config(["--task", "swe", "--sandbox", "docker", "--rollouts-per-step", "4", "--eval-timeout", "60"])
    envs, task_ids = train.make_envs(cfg, 0, 0, 4, swe_rows=rows)
    assert sorted(task_ids) == sorted(r["instance_id"] for r in rows)
    episodes = run_episodes(ScriptedAgent(tok, rows, script), codec, envs, train.rollout_config(cfg),
                            list(range(4)), task_ids)
    assert [(e.end_reason, e.reward) for e in episodes] == [("submitted", reward)] * 4
    assert all(env.sandbox is None for env in envs)
    if reward:
        assert all(env.last_grade["tests_status"]["FAIL_TO_PASS"]["success"] == env.row["FAIL_TO_PASS"]
                   for env in envs)
    assert len(spans["start"]) == len(spans["remove"]) == (8 if reward else 4)   # + a fresh one per grade
    assert most_at_once(spans["start"]) > 1 and most_at_once(spans["remove"]) > 1, spans
    assert not subprocess.run(["docker", "ps", "-aq", "--filter", f"label={RUN_LABEL}={RUN_ID}"],
                              capture_output=True, text=True).stdout.strip()


def test_a_rank_whose_sandboxes_all_fail_trains_on_with_the_others(tmp_path):
    """Two ranks, one rollout each: rank 0's task has a base commit its repository cannot have, so
    its sandbox never starts (env_error) and its batch is empty; rank 1's is whole. Every
    collective still lines up (no hang), and the update uses rank 1's tokens."""
    good, broken = load_tasks()[:2]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in (dict(broken, base_commit="0" * 40), good)))
    out = str(tmp_path / "run")
    run(["train.py", "--task", "swe", "--tasks", str(rows), "--steps", "2", "--rollouts-per-step", "2",
         "--out-dir", out] + ([] if bwrap_isolates() else ["--allow-unisolated"]), nproc=2, timeout=300)
    recs = metrics(out)
    assert [r["end/env_error"] for r in recs] == [0.5, 0.5]
    assert recs[1]["policy/tokens"] == recs[1]["rollout/trainable_tokens"] > 0


def test_swe_training_runs_in_docker_end_to_end(tmp_path):
    """train.py --task swe --sandbox docker: 2 steps of the tiny model on the built-in tasks, every
    sandbox a container of the task's image."""
    require_docker_images([r["image"] for r in load_tasks()])
    out = str(tmp_path / "run")
    run(["train.py", "--task", "swe", "--sandbox", "docker", "--steps", "2", "--rollouts-per-step", "4",
         "--max-turns", "2", "--out-dir", out])
    recs = metrics(out)
    assert [r["step"] for r in recs] == [0, 1] and "policy/approx_kl" in recs[1]
    assert all(r["end/env_error"] == 0 and r["rollout/trainable_tokens"] > 0 for r in recs)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["sandbox"] == "docker"


def test_a_run_that_would_never_update_the_policy_is_refused():
    """Steps 0 .. value_pretrain_steps − 1 train the critic only: --steps must go past them."""
    with pytest.raises(AssertionError, match="the policy would never be updated"):
        train.finalize(make(steps=50, value_pretrain_steps=50), world=8)
    train.finalize(make(steps=51, value_pretrain_steps=50), world=8)
    train.finalize(make(steps=0, value_pretrain_steps=50), world=8)  # the warm-up alone


def test_the_critic_starts_from_the_policy_that_rl_starts_from():
    """After the warm-up the policy is no longer the checkpoint both were loaded from: the critic's
    trunk is copied from it (main runs this on FSDP2 shards in test_end_to_end)."""
    from transformers import AutoModel, AutoModelForCausalLM, Qwen3Config
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, intermediate_size=64)
    torch.manual_seed(0)
    actor = train.Actor(AutoModelForCausalLM.from_config(cfg))
    critic = train.Critic(AutoModel.from_config(cfg), cfg.hidden_size)  # another random init
    train.critic_from_policy(critic, actor)
    for name, p in critic.backbone.named_parameters():
        torch.testing.assert_close(p, actor.lm.model.get_parameter(name), atol=0, rtol=0, msg=name)
    assert not critic.value_head.weight.any() and not critic.value_head.bias.any()


def test_max_format_errors_is_a_flag():
    """The rollout limit eval_swebench.py had and train.py lacked."""
    cfg = parse_config(["--max-format-errors", "7"])
    assert train.rollout_config(cfg).max_format_errors == 7


def test_estimators_go_by_name_and_the_papers_letters_are_aliases():
    assert parse_config(["--estimator", "N"]).algorithm.estimator == "per-segment"
    assert parse_config([]).algorithm.estimator == "cross-trajectory"
    masks = [(1, 0, [1, 1, 0]), (1, 1, [0, 1, 1]), (2, 0, [1, 1, 1])]

    def row(rid, seg, m):
        return {"mask": torch.tensor(m, dtype=torch.float32), "old_values": torch.rand(3), "reward": float(rid == 1),
                "rollout_id": rid, "segment_index": seg}
    torch.manual_seed(0)
    rows = [row(*m) for m in masks]
    for letter, name in (("P", "cross-trajectory"), ("E", "concatenated"), ("N", "per-segment")):
        by_letter, by_name = ([dict(r) for r in rows] for _ in range(2))
        train.advantages(by_letter, make(estimator=letter), [0, 1, 2])
        train.advantages(by_name, make(estimator=name), [0, 1, 2])
        assert all(torch.equal(a["advantages"], b["advantages"]) for a, b in zip(by_letter, by_name))


def test_every_method_knob_names_its_paper_value_or_says_the_paper_is_silent():
    """Fields of the rollout, algorithm and optimization groups each say "Paper: …" or that the
    paper does not state it; the other groups say so once, for all their fields."""
    import re
    source = open(os.path.join(ROOT, "config.py"), encoding="utf-8").read()
    groups = re.split(r"^@dataclass\nclass ", source, flags=re.M)[1:]
    seen, checked = set(), 0
    for group in groups:
        name = group.split(":", 1)[0]
        if name in ("RolloutConfig", "AlgorithmConfig", "OptimConfig"):
            for field_name, doc in re.findall(r'^    (\w+): [^\n]+\n    """(.*?)"""', group, flags=re.S | re.M):
                if field_name not in ("summary_instruction", "resume_template"):  # the task's, not flags
                    assert re.search(r"[Pp]aper", doc), f"{name}.{field_name}: no paper value, no 'not stated'"
                    checked += 1
        elif name != "Config":
            assert re.search(r"paper", group.split('"""')[1]), f"{name}: its docstring does not say"
        seen.add(name)
    assert {"RolloutConfig", "AlgorithmConfig", "OptimConfig", "ModelConfig", "TaskConfig"} <= seen
    assert checked >= 40  # every field of the three groups was read
