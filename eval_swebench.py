r"""SWE-bench Verified evaluation with context compaction, graded by the official harness.

    python eval_swebench.py                    # anywhere: embedded tiny model, built-in tasks, local grading
    python eval_swebench.py --mode docker --dataset tasks/swe/tasks.jsonl
                                               # the built-in tasks in their images (tasks/swe/build_images.py)
    python eval_swebench.py --mode docker --pull-images --model runs/swe/hf --engine vllm --kv-cache-gib 40 \
        --n-instances 200 --runs 2 --max-compactions 0 3 --max-turns 250 --temperature 1.0 \
        --context-budget 81920 --reserve 10240 --max-action-tokens 10240 --max-summary-tokens 10240
                                               # the paper's protocol (C = 65536 for the 30B model)

For each setting K in --max-compactions (0 = one window, "×1"; 3 = up to four windows, "×4") and
each run r, in <out_dir>/K<K>/run<r>/:
  1. Agent. The training loop itself, rollout.run_episodes with compaction (eqs. 7-9), over
     swe_task.SWEEnv, `workers` instances at a time. When an episode ends, the sandbox's patch is
     taken with git (sandbox.Sandbox.diff), never from the model's text.
  2. Files, written per instance as it finishes: trajectories/<id>.txt (rollout.format_episode:
     every window and summary, then the patch) and trajectories/<id>.jsonl (the same episode as
     report.py's record: token ids and text, spans, masks, log-probs); episodes.jsonl (turns,
     compactions, tokens, how it ended); preds.jsonl, the official predictions file
     ({"instance_id", "model_name_or_path", "model_patch"} per line). preds.jsonl is written last
     and is the record of what is done: an interrupted evaluation, run again with the same
     arguments, skips the instances it holds.
  3. Grading. local: swe_task.grade in-process (the patch applied to a fresh sandbox, the row's
     official eval script, swebench's get_eval_report: the harness's rules). docker:
     `python -m swebench.harness.run_evaluation` on preds.jsonl and the evaluated rows
     (instances.jsonl), then its run report JSON.
  4. The table: Pass@1 per run and their mean, ×1 vs ×K, compactions, turns, sampled tokens,
     peak context, and how episodes ended. summary.json in <out_dir> holds the same numbers, and
     <out_dir>/report.html shows the table and the episodes (report.write_eval_report).

Where we depart from the paper's evaluation:
* Scaffold. The paper runs the Terminus-KIRA agent on Harbor (a terminal agent driving tmux;
  Harbor's verifier tests the container as the agent leaves it). We evaluate in the training
  scaffold (env.py: one bash command per turn in a fenced block, mini-swe-agent style, a submit
  sentinel) with the training compaction, so the numbers measure the policy in the loop it was
  trained in; they are not comparable with the paper's absolute numbers.
* An episode that ends without submitting (turn, context or format limit) gets an empty patch,
  as its training reward is 0 (docs/method.md, 'How a rollout ends'); --grade-unsubmitted grades its
  final state, as Harbor does.
* Sampling is plain softmax(logits / T), no top-p/top-k, as in training.
* Instances run in chunks of `workers` (their episodes concurrent, each at its own pace), so a
  chunk lasts as long as its slowest episode; resuming skips whole finished instances only.
* Pass@1 is over the instances evaluated (the paper: a random 200 of the 500), not over 500.
"""
import hashlib
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import report
import swe_task
from config import GLUE_TOKENS, RolloutConfig, check_rollout, max_model_len
from engine import make_engine
from model import ChatCodec, build_tiny_model, check_positions, load_tokenizer
from rollout import format_episode, run_episodes
from rundir import ensure_tiny_model
from sandbox import DiffError, check_docker_images, check_isolation
from train import tiny_corpus

VERIFIED = "SWE-bench/SWE-bench_Verified"
PREDICTION_KEYS = ("instance_id", "model_name_or_path", "model_patch")
TINY_MODEL_NAME = "compactionrl-tiny"


@dataclass
class EvalRollout(RolloutConfig):
    """The agent loop's limits (train.py's knobs; K is a list here, --max-compactions)."""
    max_compactions: tyro.conf.Suppress[int] = 3


@dataclass
class Config:
    # --- model ----------------------------------------------------------------------------------
    model: str = ""
    """Policy checkpoint: Hugging Face id or local path. Empty = the embedded tiny model (out_dir/tiny_model)."""
    model_name: str = ""
    """`model_name_or_path` written in preds.jsonl. Empty = --model, or "compactionrl-tiny"."""
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine: vllm (vllm_engine.VLLMEngine) or hf (transformers generate);
    auto = vllm when it is installed and a GPU is present, else hf."""
    max_model_len: int = 0
    """vLLM's longest context (prompt + generation), tokens; 0 = the longest sequence an episode can
    reach (config.max_model_len: C, one observation past it, q_sum and the summary)."""
    kv_cache_gib: float = 0.0
    """vLLM KV-cache size, GiB. 0 = VLLMEngine's default, sized to share a device with training;
    evaluation alone can give it most of the GPU (it must hold at least one max_model_len context)."""
    # --- instances ------------------------------------------------------------------------------
    mode: Literal["local", "docker"] = "local"
    """local: rows with a repo_dir (the built-in tasks), bubblewrap sandboxes, graded in-process
    (swe_task.grade, as training grades); docker: each row's image, graded by --grader."""
    grader: Literal["harness", "sandbox"] = "harness"
    """--mode docker: who grades the patches. harness: the official run_evaluation (the leaderboard's
    grader), whose containers run the patch's code with CAP_SYS_ADMIN added and no limits; sandbox:
    swe_task.grade in this project's DockerSandbox (no network, no capability past file ownership,
    limits), with the harness's own eval script, apply commands and log parser, as training grades.
    For a policy you do not trust, sandbox."""
    dataset: str = ""
    """Task rows (swe_task.load_tasks): a Hugging Face dataset id or folder, or a .json/.jsonl/.parquet
    file, in SWE-bench's schema. Empty = tasks/swe/tasks.jsonl (local) or SWE-bench/SWE-bench_Verified
    (docker). The built-in tasks run in docker mode too, once tasks/swe/build_images.py built their images."""
    split: str = "test"
    """Dataset split (HF datasets)."""
    instance_ids: tuple[str, ...] = ()
    """Evaluate exactly these instances. Empty = all of them, or a random subset (--n-instances)."""
    n_instances: int = 0
    """Size of a random subset (0 = every instance). Paper: 200 of the 500 Verified instances."""
    subset_seed: int = 0
    """Seed of the random subset; every setting and run sees the same instances."""
    # --- protocol -------------------------------------------------------------------------------
    runs: int = 2
    """Independent runs per setting; Pass@1 is their mean. Paper: 2."""
    max_compactions: tuple[int, ...] = (3,)
    """K settings, each a full set of runs: 0 = one window ("×1"), 3 = up to four windows ("×4").
    Paper: 0 and 3 (--max-compactions 0 3)."""
    grade_unsubmitted: bool = False
    """Also grade the final state of episodes that ended without submitting, as Harbor does.
    Off = the training reward's rule (docs/method.md, 'How a rollout ends'): no submission, empty patch."""
    # --- sandboxes and grading ------------------------------------------------------------------
    command_timeout: float = 60.0
    """Seconds one agent command may run. Paper: not stated."""
    eval_timeout: int = 1800
    """Seconds for one instance's tests: the harness's --timeout (its default), and local grading's."""
    pull_images: bool = False
    """--mode docker: pull the images that are not present before the evaluation starts. Off: a missing
    image stops it at start, named."""
    allow_unisolated: bool = False
    """--mode local: run agent commands as plain processes when bubblewrap cannot isolate them. Off:
    the evaluation stops before loading the model, naming the fix (`apt-get install bubblewrap`)."""
    workers: int = 8
    """Instances per chunk: their episodes run together (each at its own pace, the environments on
    --env-workers threads), then their patches are graded on this many threads. A chunk lasts as
    long as its slowest episode."""
    harness_workers: int = 4
    """Containers the official harness runs at once (--max_workers; it advises < 0.75 · cores)."""
    # --- run ------------------------------------------------------------------------------------
    seed: int = 0
    """Seed of the tiny model's weights and of sampling (run r of setting K samples from a seed of (seed, K, r))."""
    out_dir: str = "runs/eval"
    """Where the runs, summary.json and the tiny model go."""
    # --- the agent loop: the same knobs as train.py's ------------------------------------------
    rollout: tyro.conf.OmitArgPrefixes[EvalRollout] = field(default_factory=lambda: EvalRollout(
        context_budget=2048, reserve=256, max_action_tokens=256, max_summary_tokens=256))


def check_config(cfg):
    assert min(cfg.runs, cfg.workers, cfg.harness_workers) >= 1, "runs, workers and harness_workers must be >= 1"
    assert cfg.max_compactions and min(cfg.max_compactions) >= 0, "max_compactions: give one or more K >= 0"
    assert len(set(cfg.max_compactions)) == len(cfg.max_compactions), "max_compactions: each K once"
    check_rollout(cfg.rollout)
    assert not (cfg.instance_ids and cfg.n_instances), "give --instance-ids or --n-instances, not both"


# ---------------------------------------------------------------- instances

def load_instances(dataset, split, mode):
    """The dataset's rows, read and validated as training reads them (swe_task.load_tasks), and
    checked against `mode`: local mode copies each row's repo_dir."""
    rows = swe_task.load_tasks(dataset, split)
    if mode == "local":
        swe_task.check_local_rows(rows, dataset)
    return rows


def select_instances(rows, instance_ids=(), n=0, seed=0, source="the dataset"):
    """The named instances (in the given order), a random subset of n (in dataset order), or all."""
    by_id = {r["instance_id"]: r for r in rows}
    if instance_ids:
        if unknown := [i for i in instance_ids if i not in by_id]:
            raise ValueError(f"unknown instance ids, not in {source}: {unknown}")
        if twice := [i for i, c in Counter(instance_ids).items() if c > 1]:
            raise ValueError(f"instance ids given twice: {twice}")
        return [by_id[i] for i in instance_ids]
    if n:
        if not 0 < n <= len(rows):
            raise ValueError(f"--n-instances {n}: {source} has {len(rows)} instances")
        chosen = set(random.Random(seed).sample(sorted(by_id), n))
        return [r for r in rows if r["instance_id"] in chosen]
    return rows


# ---------------------------------------------------------------- files

def read_jsonl(path):
    """[(line number, object)] of a JSON-lines file; an error names the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not valid JSON ({e}); an interrupted write leaves a cut-off "
                                 "last line: delete that line to resume") from e
    return out


def append_jsonl(path, obj):
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")   # one write per line: an interruption cuts one line at most


def read_predictions(path, model_name):
    """{instance_id: prediction} of an existing preds.jsonl ({} if there is none), checked: the
    official keys with string values, each instance once, all from `model_name` (a resumed run
    must not mix models)."""
    if not os.path.exists(path):
        return {}
    preds = {}
    for n, pred in read_jsonl(path):
        where = f"{path}, line {n}"
        if not isinstance(pred, dict) or sorted(pred) != sorted(PREDICTION_KEYS) \
                or not all(isinstance(pred[k], str) for k in PREDICTION_KEYS):
            raise ValueError(f"{where}: expected an object with string fields {PREDICTION_KEYS}, "
                             f"got {str(pred)[:200]}")
        if pred["model_name_or_path"] != model_name:
            raise ValueError(f"{where}: written for model {pred['model_name_or_path']!r}, but this evaluation "
                             f"is of {model_name!r}: use another --out-dir")
        if pred["instance_id"] in preds:
            raise ValueError(f"{where}: instance {pred['instance_id']!r} appears twice")
        preds[pred["instance_id"]] = pred
    return preds


def safe_name(instance_id):
    return re.sub(r"[^\w.-]", "_", instance_id)


# ---------------------------------------------------------------- the agent

class RecordingEnv(swe_task.SWEEnv):
    """SWEEnv that takes the sandbox's patch when run_episodes closes it (after the episode, before
    the sandbox is gone) and leaves grading to the evaluation, so nothing is graded twice."""

    def __init__(self, row, sandbox_factory, **kwargs):
        super().__init__(row, sandbox_factory, **kwargs)
        self.patch, self.patch_error = None, ""

    def reward(self):
        return 0.0   # run_episodes asks for it; the real grade comes after (grade_locally or the harness)

    def close(self):
        try:
            if self.sandbox is not None and self.patch is None:
                self.patch = self.diff()
        except DiffError as e:   # the agent broke the repository's git state: no patch
            self.patch, self.patch_error = "", str(e)
        finally:
            super().close()

    def discard(self):
        """Close without taking a patch (an interrupted batch; a no-op after close)."""
        super().close()


def episode_record(ep, k, run, patch, patch_error, resolved):
    """One line of episodes.jsonl: what the table needs about an instance."""
    summary_tokens = sum(b - a for s in ep.segments for kind, a, b in s.spans if kind == "summary")
    return {"instance_id": ep.task_id, "max_compactions": k, "run": run, "end_reason": ep.end_reason,
            "turns": ep.turns, "compactions": ep.compactions,
            "sampled_tokens": sum(s.n_tokens for s in ep.segments), "summary_tokens": summary_tokens,
            "peak_context": max((len(s.ids) for s in ep.segments), default=0),
            "patch_lines": patch.count("\n"), "patch_error": patch_error, "resolved": resolved}


def trajectory_text(ep, decode, patch, env):
    """The readable file of one instance: every window (rollout.format_episode), then the patch."""
    if patch:
        note = "taken from the sandbox with git"
    elif env.patch:
        note = (f"empty: the episode ended by {ep.end_reason} without submitting (--grade-unsubmitted "
                f"grades it); the sandbox's final diff was:\n{env.patch}")
    else:
        note = f"empty: {env.patch_error or 'no changes'}"
    pending = "reward nan: graded later, by the official harness\n" if math.isnan(ep.reward) else ""
    return f"{pending}{format_episode(ep, decode)}\n=== model_patch ({note})\n{patch}"


def grade_locally(rows, patches, make_sandbox, timeout, workers):
    """swe_task.grade of each patch (fresh sandbox, official eval script, swebench's report)."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda row, patch: swe_task.grade(row, patch, make_sandbox, timeout), rows, patches))


def run_agent(engine, codec, rows, rollout_cfg, make_sandbox, run_dir, model_name, *, k, run, workers,
              command_timeout, eval_timeout, local_grading, grade_unsubmitted, label):
    """Runs the instances of `rows` not yet in run_dir/preds.jsonl, `workers` at a time, and
    writes each one's trajectory, episode record and prediction (in that order)."""
    preds_path = os.path.join(run_dir, "preds.jsonl")
    done = read_predictions(preds_path, model_name)
    todo = [(i, r) for i, r in enumerate(rows) if r["instance_id"] not in done]
    for sub in ("trajectories", "test_output") if local_grading else ("trajectories",):
        os.makedirs(os.path.join(run_dir, sub), exist_ok=True)
    with tqdm(total=len(rows), initial=len(rows) - len(todo), desc=label, unit="instance") as bar:
        for start in range(0, len(todo), workers):
            batch = todo[start:start + workers]
            envs = [RecordingEnv(r, make_sandbox, command_timeout=command_timeout) for _, r in batch]
            try:
                episodes = run_episodes(engine, codec, envs, rollout_cfg, [i for i, _ in batch],
                                        [r["instance_id"] for _, r in batch])
            finally:
                for env in envs:
                    env.discard()
            graded = [ep.end_reason == "submitted" or grade_unsubmitted for ep in episodes]
            patches = [(env.patch or "") if g else "" for env, g in zip(envs, graded)]
            batch_rows = [r for _, r in batch]
            grades = (grade_locally(batch_rows, patches, make_sandbox, eval_timeout, workers) if local_grading
                      else [None] * len(batch))
            for row, ep, env, patch, g in zip(batch_rows, episodes, envs, patches, grades):
                iid, name = row["instance_id"], safe_name(row["instance_id"])
                resolved = g["resolved"] if g else None   # None: the harness grades it after the run
                ep.reward = float(resolved) if g else float("nan")
                with open(os.path.join(run_dir, "trajectories", f"{name}.txt"), "w", encoding="utf-8") as f:
                    f.write(trajectory_text(ep, codec.tok.decode, patch, env))
                report.write_episode(os.path.join(run_dir, "trajectories", f"{name}.jsonl"), ep, codec.tok.decode)
                if g:
                    with open(os.path.join(run_dir, "test_output", f"{name}.txt"), "w", encoding="utf-8") as f:
                        f.write(g["log"])
                append_jsonl(os.path.join(run_dir, "episodes.jsonl"),
                             episode_record(ep, k, run, patch, env.patch_error, resolved))
                append_jsonl(preds_path,   # last: a line here means the instance is done
                             {"instance_id": iid, "model_name_or_path": model_name, "model_patch": patch})
            bar.update(len(batch))


# ---------------------------------------------------------------- the official harness

def harness_command(dataset, split, predictions_path, run_id, instance_ids, max_workers, timeout, report_dir):
    """argv of the official harness (flags of swebench 5.0.2's run_evaluation)."""
    return [sys.executable, "-m", "swebench.harness.run_evaluation", "-d", dataset, "-s", split,
            "-p", predictions_path, "-id", run_id, "--max_workers", str(max_workers),
            "--timeout", str(timeout), "--report_dir", report_dir, "-i", *instance_ids]


def harness_run_id(run_dir, predictions_path):
    """Unique to this run folder and these predictions. The harness reuses an instance's
    report.json whenever the run id matches, even if the patch changed, and names containers by
    run id, so a run id must never be shared by different predictions or concurrent evaluations."""
    h = hashlib.sha256(os.path.abspath(run_dir).encode())
    with open(predictions_path, "rb") as f:
        h.update(f.read())
    return f"compactionrl-{h.hexdigest()[:16]}"


def report_path(report_dir, model_name, run_id):
    """Where the harness writes its run report (named after the first prediction's model)."""
    return os.path.join(report_dir, f"{model_name.replace('/', '__')}.{run_id}.json")


def read_harness_report(path, instance_ids):
    """{instance_id: resolved | unresolved | empty_patch | error | incomplete} from a run report."""
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    outcome = {}
    for key, name in (("resolved_ids", "resolved"), ("unresolved_ids", "unresolved"),
                      ("empty_patch_ids", "empty_patch"), ("error_ids", "error")):
        if key not in report:
            raise ValueError(f"{path}: not a swebench run report (no {key!r})")
        for iid in report[key]:
            outcome.setdefault(iid, name)
    return {iid: outcome.get(iid, "incomplete") for iid in instance_ids}


def write_instances(path, rows):
    """The rows to grade, as the JSON lines the harness reads with -d (values JSON cannot hold,
    such as a parquet row's timestamps, as text)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
    return path


def run_harness(rows, run_dir, model_name, max_workers, timeout):
    """Grades run_dir/preds.jsonl with the official harness, run in run_dir (its logs/ go there),
    on `rows` written to run_dir/instances.jsonl: the harness grades exactly the rows the agent
    ran on (with their derived image names) and reads no dataset again."""
    run_dir = os.path.abspath(run_dir)
    preds = os.path.join(run_dir, "preds.jsonl")
    run_id = harness_run_id(run_dir, preds)
    instances = write_instances(os.path.join(run_dir, "instances.jsonl"), rows)
    ids = [r["instance_id"] for r in rows]
    argv = harness_command(instances, "test", preds, run_id, ids, max_workers, timeout, run_dir)
    log_path = os.path.join(run_dir, "harness.log")
    print(f"grading with the official harness (output: {log_path}):\n  {shlex.join(argv)[:400]}")
    with open(log_path, "w", encoding="utf-8") as log:
        code = subprocess.run(argv, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT).returncode
    path = report_path(run_dir, model_name, run_id)
    if code != 0 or not os.path.exists(path):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"the SWE-bench harness failed (exit code {code}, report {path} "
                           f"{'present' if os.path.exists(path) else 'missing'}); its output, in {log_path}, "
                           f"ends:\n{tail}")
    return read_harness_report(path, ids)


# ---------------------------------------------------------------- results

def read_records(run_dir, instance_ids):
    """The episodes.jsonl record of each instance (the last one written wins)."""
    path = os.path.join(run_dir, "episodes.jsonl")
    records = {rec["instance_id"]: rec for _, rec in read_jsonl(path)} if os.path.exists(path) else {}
    return {i: records[i] for i in instance_ids if i in records}


def local_outcomes(records, predictions, instance_ids):
    """The harness's outcome names, from local grades."""
    def outcome(i):
        if not predictions[i]["model_patch"]:
            return "empty_patch"
        return "resolved" if records.get(i, {}).get("resolved") else "unresolved"
    return {i: outcome(i) for i in instance_ids}


MEANS = ("compactions", "turns", "sampled_tokens", "summary_tokens", "peak_context")   # per instance


def run_stats(records, outcomes):
    """Pass@1 of one run, means of MEANS over the instances with a record, and how episodes ended
    and were graded."""
    recs = list(records.values())
    resolved = sum(o == "resolved" for o in outcomes.values())
    return {"pass@1": resolved / len(outcomes), "resolved": resolved, "instances": len(outcomes),
            **{key: sum(r[key] for r in recs) / len(recs) if recs else float("nan") for key in MEANS},
            "ended": dict(Counter(r["end_reason"] for r in recs)), "graded": dict(Counter(outcomes.values())),
            "outcomes": outcomes}


def format_table(results):
    """results: {K: [run_stats per run]} -> the printed table: each run, the mean, ×K − ×1."""
    def line(setting, run, s, resolved=""):
        counts = lambda d: ", ".join(f"{k} {v}" for k, v in sorted(d.items()))  # noqa: E731
        graded = f" | {counts(s['graded'])}" if "graded" in s else ""
        return (f"{setting:<8}{run:>5}{s['pass@1']:>8.3f}{resolved:>10}{s['compactions']:>8.2f}{s['turns']:>7.1f}"
                f"{s['sampled_tokens']:>9.0f}{s['peak_context']:>9.0f}  {counts(s.get('ended', {}))}{graded}")
    lines = [f"{'setting':<8}{'run':>5}{'pass@1':>8}{'resolved':>10}{'compact':>8}{'turns':>7}{'tokens':>9}"
             f"{'peak ctx':>9}  ended | graded",
             "(×1: one window, K = 0; ×N: up to N−1 compactions. Means per instance; tokens: sampled.)"]
    mean = {}
    for k, runs in results.items():
        lines += [line(f"×{k + 1}", r, s, f"{s['resolved']}/{s['instances']}") for r, s in enumerate(runs)]
        mean[k] = {key: sum(s[key] for s in runs) / len(runs) for key in ("pass@1", *MEANS)}
        lines.append(line(f"×{k + 1}", "mean", mean[k]))
    base = min(results)
    lines += [f"×{k + 1} − ×{base + 1}: Pass@1 {mean[k]['pass@1'] - mean[base]['pass@1']:+.3f}"
              for k in results if k != base]
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def load_model(cfg):
    """(engine, tokenizer) of --model, or of the embedded tiny model (built once into out_dir)."""
    model_path = cfg.model or os.path.join(cfg.out_dir, "tiny_model")
    if not cfg.model:   # built atomically, and again if --seed changed
        # RoPE has no learned positions: 8192 only lets vLLM accept windows past the default C
        ensure_tiny_model(model_path, {"max_positions": 8192, "seed": cfg.seed}, False,
                          partial(build_tiny_model, corpus=tiny_corpus()))
    tokenizer = load_tokenizer(model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    longest = cfg.max_model_len or max_model_len(cfg.rollout)
    check_positions(model_path, longest, f"--max-model-len, or --context-budget + --max-observation-tokens + "
                                         f"--max-summary-tokens + {GLUE_TOKENS}")
    engine = make_engine(cfg.engine, model_path, pad, "cuda" if torch.cuda.is_available() else "cpu",
                         seed=cfg.seed, max_model_len=longest,
                         kv_cache_bytes=int(cfg.kv_cache_gib * 2**30) if cfg.kv_cache_gib else None)
    return engine, tokenizer


def main(cfg, engine=None, tokenizer=None):
    """Evaluates and returns {K: [run_stats per run]}. `engine` and `tokenizer` replace the ones
    built from --model (tests, notebooks)."""
    check_config(cfg)
    dataset = cfg.dataset or (swe_task.BUILTIN_TASKS_FILE if cfg.mode == "local" else VERIFIED)
    rows = load_instances(dataset, cfg.split, cfg.mode)
    rows = select_instances(rows, cfg.instance_ids, cfg.n_instances, cfg.subset_seed, dataset)
    ids = [r["instance_id"] for r in rows]
    if cfg.mode == "docker":   # a daemon, and every image here: nothing is pulled mid-evaluation
        check_docker_images(sorted({r["image"] for r in rows}), pull=cfg.pull_images)
    local = cfg.mode == "local"
    in_process = local or cfg.grader == "sandbox"   # swe_task.grade in our sandboxes, not the harness
    if local and not cfg.allow_unisolated:
        check_isolation()
    model_name = cfg.model_name or cfg.model or TINY_MODEL_NAME
    if engine is None:
        engine, tokenizer = load_model(cfg)
    codec = ChatCodec(tokenizer)
    swe_task.check_prompts_fit(rows, codec, cfg.rollout.context_budget, cfg.rollout.reserve, cfg.command_timeout)
    make_sandbox = swe_task.local_sandbox_factory(isolated=not cfg.allow_unisolated) if local else \
        swe_task.docker_sandbox_factory()
    results = {}
    for k in cfg.max_compactions:
        rollout_cfg = replace(cfg.rollout, max_compactions=k)
        results[k] = []
        for r in range(cfg.runs):
            run_dir = os.path.join(cfg.out_dir, f"K{k}", f"run{r}")
            torch.manual_seed(cfg.seed * 1_000_003 + k * 1009 + r)   # both engines draw sampling seeds from it
            run_agent(engine, codec, rows, rollout_cfg, make_sandbox, run_dir, model_name, k=k, run=r,
                      workers=cfg.workers, command_timeout=cfg.command_timeout, eval_timeout=cfg.eval_timeout,
                      local_grading=in_process, grade_unsubmitted=cfg.grade_unsubmitted,
                      label=f"×{k + 1} run {r}")
            records = read_records(run_dir, ids)
            if in_process:
                preds = read_predictions(os.path.join(run_dir, "preds.jsonl"), model_name)
                outcomes = local_outcomes(records, preds, ids)
            else:
                outcomes = run_harness(rows, run_dir, model_name, cfg.harness_workers, cfg.eval_timeout)
            results[k].append(run_stats(records, outcomes))
    with open(os.path.join(cfg.out_dir, "summary.json"), "w", encoding="utf-8") as f:
        config = asdict(cfg)
        del config["rollout"]["max_compactions"]  # K is the list cfg.max_compactions
        json.dump({"config": config, "model_name": model_name, "dataset": dataset,
                   "results": {f"K{k}": runs for k, runs in results.items()}}, f, indent=1)
    table = format_table(results)
    page = report.write_eval_report(cfg.out_dir, {f"×{k + 1} run {r}": os.path.join(cfg.out_dir, f"K{k}", f"run{r}")
                                                  for k in results for r in range(cfg.runs)}, table)
    print(f"\n{model_name} on {len(ids)} instances of {dataset}, {cfg.runs} run(s) per setting:")
    print(table)
    print(f"episodes: {page}")
    return results


if __name__ == "__main__":
    main(tyro.cli(Config))
