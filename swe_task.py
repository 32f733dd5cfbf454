"""SWE tasks: SWE-bench rows, the agent's environment, and grading with swebench's own code.

A task is one row in the SWE-bench schema as swebench 5 reads it (`REQUIRED_FIELDS`): SWE-bench
Verified's rows (its own columns: instance_id, repo, base_commit, problem_statement, patch,
test_patch, FAIL_TO_PASS, PASS_TO_PASS, version, and swebench 5's eval_script, log_parser,
eval_type, image), from a local .jsonl/.json/.parquet file or a Hugging Face dataset, and our
built-in toy tasks (tasks/swe/, built by tasks/swe/build_tasks.py) are the same shape
(`load_tasks`). A row without an image gets the name the harness derives (`image_name`).
A row runs in a `DockerSandbox` of its image, or, when it has a `repo_dir` (relative to the
tasks file; the built-in rows do), in a `LocalSandbox` copy of that folder.

Episode: `reset()` -> system + user messages (`task_messages`); `step(action)` runs one fenced
command (env.parse_action) in the sandbox; the sentinel ends it; `reward()` grades the diff.

Grading (`grade`), shared by training and evaluation's local mode, follows the official harness
(swebench.harness.run_evaluation.run_instance) minus its logging, caching and
containers-by-run-id: the patch, taken from the sandbox with git and never from the model's
text, is applied to a FRESH sandbox of the base repository with the harness's own fallback chain
(GIT_APPLY_CMDS); the eval script of `make_test_spec(row)` (the row's test command, with the
harness's exit-code recording and markers) runs there under the harness's timeout
(HARNESS_TIMEOUT unless set); swebench's `get_eval_report` grades the log with the row's parser.
Reward 1 only when every FAIL_TO_PASS and PASS_TO_PASS test passes. Departures: an empty patch
is not run (as in the harness) but graded unresolved here rather than skipped; the harness's
final "already applied?" check is dropped (a patch from a clean base cannot be); a tree is reset
between apply attempts with `git reset --hard` (the harness: `git checkout -- .`, which leaves
the index as a failed --3way left it); the eval script runs in the sandbox's working folder (a
container's /testbed; a LocalSandbox's copy) and a DockerSandbox keeps its limits (the harness's
containers have none, and add CAP_SYS_ADMIN, which only browser-sandbox tests need).
"""
from __future__ import annotations

import json
import logging
import os
import shlex
import tempfile
import time
from collections.abc import Callable

from swebench.harness.constants import (APPLY_PATCH_FAIL, END_TEST_OUTPUT, START_TEST_OUTPUT, TESTS_TIMEOUT,
                                        EvalType)
from swebench.harness.grading import get_eval_report
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.run_evaluation import GIT_APPLY_CMDS
from swebench.harness.utils import load_swebench_dataset, make_test_spec
from swebench.image_builder.image_spec import ImageSpec

from env import SUBMIT_SENTINEL, Step, format_observation, is_submission, parse_action
from sandbox import DiffError, DockerSandbox, LocalSandbox, Sandbox, SandboxError

logger = logging.getLogger(__name__)

PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))
BUILTIN_TASKS_DIR = os.path.join(PROJECT_DIR, "tasks", "swe")
BUILTIN_TASKS_FILE = os.path.join(BUILTIN_TASKS_DIR, "tasks.jsonl")
REQUIRED_FIELDS = {
    "instance_id": str, "repo": str, "base_commit": str, "problem_statement": str, "patch": str,
    "test_patch": str, "FAIL_TO_PASS": list, "PASS_TO_PASS": list, "version": str, "image": str,
    "eval_script": str, "log_parser": str, "eval_type": str,
}
SWEBENCH5_COLUMNS = ("eval_script", "log_parser", "eval_type")   # rows carry these since swebench 5
HARNESS_TIMEOUT = 1800   # seconds: the official harness's --timeout default, for one instance's tests
EVAL_MAX_OUTPUT_BYTES = 16 * 1024 * 1024   # a test log, head and tail kept (the -rA summary is at the end)
SandboxFactory = Callable[[dict], Sandbox]


# ---------------------------------------------------------------- rows

def image_name(instance_id: str, namespace: str | None = "swebench") -> str:
    """The image swebench names for an instance (ImageSpec.name): published under `namespace`,
    with `__` spelled `_1776_` as Docker Hub requires (swebench/sweb.eval.x86_64.<id>:latest), or,
    with namespace None, as it names an image built locally (sweb.eval.x86_64.<id>:latest)."""
    return ImageSpec(instance_id=instance_id, dockerfile="(not built here)", namespace=namespace).name


def validate_row(row: dict, index: int) -> dict:
    """Checks one row; returns a copy with FAIL_TO_PASS/PASS_TO_PASS as lists and, when the row
    names no image, the published one (`image_name`).

    Raises ValueError naming the row (index, instance_id) and the field at fault.
    """
    def fail(field: str, problem: str):
        iid = row.get("instance_id")
        raise ValueError(f"task row {index} (instance_id={iid!r}): field {field!r} {problem}")

    if not isinstance(row, dict):
        raise ValueError(f"task row {index}: expected a JSON object, got {type(row).__name__}")
    row = dict(row)
    for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):   # HF rows carry these as JSON strings
        if isinstance(row.get(field), str):
            try:
                row[field] = json.loads(row[field])
            except json.JSONDecodeError as e:
                fail(field, f"is not valid JSON ({e})")
    if not row.get("image") and isinstance(row.get("instance_id"), str):
        row["image"] = image_name(row["instance_id"])
    for field, kind in REQUIRED_FIELDS.items():
        if field not in row:
            fail(field, "is missing")
        if not isinstance(row[field], kind):
            fail(field, f"must be a {kind.__name__}, got {type(row[field]).__name__}")
    for field in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if not all(isinstance(test, str) for test in row[field]):
            fail(field, "must be a list of test ids (strings)")
    if row["log_parser"] not in PARSER_REGISTRY:
        fail("log_parser", f"is {row['log_parser']!r}, not one of swebench's parsers (e.g. parse_log_pytest)")
    if row["eval_type"] not in {t.value for t in EvalType}:
        fail("eval_type", f"is {row['eval_type']!r}, expected one of {[t.value for t in EvalType]}")
    if START_TEST_OUTPUT not in row["eval_script"] or END_TEST_OUTPUT not in row["eval_script"]:
        fail("eval_script", f"lacks the markers {START_TEST_OUTPUT!r} / {END_TEST_OUTPUT!r}")
    if "repo_dir" in row and not isinstance(row["repo_dir"], str):
        fail("repo_dir", f"must be a folder (relative to the tasks file), got {type(row['repo_dir']).__name__}")
    return row


def is_file_source(source: str) -> bool:
    return source.endswith((".jsonl", ".json", ".parquet"))


def read_rows(source: str, split: str = "test") -> list[dict]:
    """The raw rows of a .jsonl, .json (a list) or .parquet file, or, for any other source, of a
    Hugging Face dataset (an id such as SWE-bench/SWE-bench_Verified, a folder with <split>.parquet,
    or a `save_to_disk` folder) read by swebench's own loader, as the harness reads it. A line
    that is not JSON raises ValueError naming the file, line and column."""
    if source.endswith(".jsonl"):
        rows = []
        with open(source, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):  # 1-based, blank lines counted: what an editor shows
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line.rstrip("\n")))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{source}, line {number}, column {e.colno}: not valid JSON ({e.msg})") from e
        return rows
    if source.endswith(".json"):
        with open(source, encoding="utf-8") as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{source}: expected a JSON list of task rows, got {type(rows).__name__}")
        return rows
    if source.endswith(".parquet"):
        import pandas  # optional: only parquet needs it
        rows = pandas.read_parquet(source).to_dict(orient="records")
        for row in rows:   # list columns come back as numpy arrays
            row.update({k: v.tolist() for k, v in row.items() if hasattr(v, "tolist")})
        return rows
    return [dict(row) for row in load_swebench_dataset(source, split)]


def check_columns(rows: list[dict], source: str, split: str) -> None:
    """Rows without swebench 5's columns: one error for the whole dataset, naming the fix."""
    lacking = {c: sum(c not in row for row in rows) for c in SWEBENCH5_COLUMNS}
    if missing := [c for c, n in lacking.items() if n]:
        counts = ", ".join(f"{c} (absent from {lacking[c]} of {len(rows)} rows)" for c in missing)
        raise ValueError(
            f"dataset {source} (split {split!r}) lacks columns that swebench 5 needs: {counts}. swebench 5 no "
            f"longer builds eval scripts; every row must carry {', '.join(SWEBENCH5_COLUMNS)}. Fix: use a "
            "dataset republished for swebench 5 (SWE-bench/SWE-bench_Verified from the SWE-bench maintainers, "
            "not a princeton-nlp/... copy), or pin swebench==4.1.0 for the harness (in a separate environment: "
            "this project's grader imports swebench 5).")


def load_tasks(source: str = BUILTIN_TASKS_FILE, split: str = "test") -> list[dict]:
    """Reads (`read_rows`) and validates the rows of `source`: what training and evaluation both
    run on. `repo_dir` of file rows is made absolute, relative to the file's folder. An empty
    source, a missing column, a bad row or a repeated instance_id raises ValueError naming it."""
    rows = read_rows(source, split)
    if not rows:
        raise ValueError(f"{source} holds no task rows")
    check_columns(rows, source, split)
    rows = [validate_row(row, i) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        if (first := seen.setdefault(row["instance_id"], i)) != i:
            raise ValueError(f"{source}: task rows {first} and {i} share instance_id {row['instance_id']!r}")
        if "repo_dir" in row and is_file_source(source):
            row["repo_dir"] = os.path.join(os.path.dirname(os.path.abspath(source)), row["repo_dir"])
            if not os.path.isdir(row["repo_dir"]):
                raise ValueError(f"task row {i} (instance_id={row['instance_id']!r}): field 'repo_dir' "
                                 f"points to {row['repo_dir']}, which is not a folder")
    return rows


def check_local_rows(rows: list[dict], source: str) -> None:
    """A LocalSandbox copies a row's repo_dir: rows without one (SWE-bench's) need containers."""
    if lacking := [r["instance_id"] for r in rows if "repo_dir" not in r]:
        raise ValueError(f"{len(lacking)} rows of {source} (e.g. {lacking[0]}) have no repo_dir for a local "
                         f"sandbox: they run in their Docker images (train.py --sandbox docker, "
                         f"eval_swebench.py --mode docker)")


# ---------------------------------------------------------------- sandboxes per row

def local_sandbox_factory(**kwargs) -> SandboxFactory:
    """Rows with a repo_dir: a LocalSandbox of it at `base_commit` (kwargs go to LocalSandbox).
    The sandbox shows commands nothing of this project (its task files and git history hold the
    gold patches) but our venv."""
    def make(row: dict) -> Sandbox:
        check_local_rows([row], "the tasks")
        return LocalSandbox(row["repo_dir"], row["base_commit"], **kwargs)
    return make


def docker_sandbox_factory(**kwargs) -> SandboxFactory:
    """Any row: a container of its `image` (kwargs go to DockerSandbox)."""
    return lambda row: DockerSandbox(row["image"], row["base_commit"], **kwargs)


# ---------------------------------------------------------------- grading

def apply_patch(sandbox: Sandbox, patch: str, timeout: float = 120.0) -> tuple[bool, str]:
    """Tries the harness's GIT_APPLY_CMDS in order, resetting the tree between tries; returns
    (applied, log)."""
    path, log = sandbox.write_file("patch.diff", patch), []
    for attempt, command in enumerate(GIT_APPLY_CMDS):
        if attempt:   # a failed try (notably --reject) can leave a half-applied tree behind
            reset = sandbox.run("git reset -q --hard && git clean -q -fd", timeout)
            if reset.returncode != 0:
                raise SandboxError(f"could not reset the grading sandbox: {reset.output}")
        result = sandbox.run(f"{command} {shlex.quote(path)}", timeout)
        log.append(f"$ {command}\n{result.output}")
        if result.returncode == 0:
            return True, "\n".join(log)
    return False, "\n".join(log)


def report_from_log(spec, patch: str, log: str) -> dict:
    """swebench's report for one instance, from the text of its test log."""
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "test_output.txt")
        with open(log_path, "w", encoding="utf-8") as f:
            f.write(log)
        prediction = {"instance_id": spec.instance_id, "model_name_or_path": "compactionrl",
                      "model_patch": patch}
        return get_eval_report(spec, prediction, log_path, include_tests_status=True)[spec.instance_id]


def grade(row: dict, patch: str, sandbox_factory: SandboxFactory, timeout: float = HARNESS_TIMEOUT) -> dict:
    """Grades `patch` on a fresh sandbox of `row`; `timeout` bounds the eval script (seconds).

    Returns {"instance_id", "resolved": bool, "patch_applied": bool, "tests_status": swebench's
    {FAIL_TO_PASS: {success, failure}, PASS_TO_PASS: ...} or None when no tests ran, "log": str}.
    """
    out = {"instance_id": row["instance_id"], "resolved": False, "patch_applied": False,
           "tests_status": None, "log": ""}
    if not patch.strip():
        return {**out, "log": "empty patch: not evaluated (as in the swebench harness)"}
    spec = make_test_spec(row)
    with sandbox_factory(row) as sandbox:
        applied, apply_log = apply_patch(sandbox, patch)
        if not applied:
            return {**out, "log": f"{APPLY_PATCH_FAIL}\n{apply_log}"}
        script = sandbox.write_file("eval.sh", spec.eval_script)
        result = sandbox.run(f"bash {shlex.quote(script)}", timeout, EVAL_MAX_OUTPUT_BYTES)
    log = result.output + (f"\n{TESTS_TIMEOUT}\n" if result.timed_out else "")   # the harness's marker
    report = report_from_log(spec, patch, log)
    return {**out, "resolved": report["resolved"], "patch_applied": True,
            "tests_status": report.get("tests_status"), "log": log}


# ---------------------------------------------------------------- the environment

def retry(fn: Callable, attempts: int, what: str, backoff_s: float = 1.0):
    """fn(), tried up to `attempts` times while it raises SandboxError (a container that did not
    start, a daemon that hiccupped), waiting backoff_s, 2·backoff_s, ... between tries. Anything
    else, and the last SandboxError, propagates: the episode then ends as env_error."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except SandboxError as e:
            if attempt == attempts:
                raise
            logger.warning("%s failed (attempt %d of %d), retrying: %s", what, attempt, attempts, e)
            time.sleep(backoff_s * 2 ** (attempt - 1))


SYSTEM_PROMPT = f"""You are a software engineer resolving an issue in a code repository through a shell.

In every reply, briefly explain your next step, then give exactly ONE shell command in ONE fenced block:

```bash
<command>
```

Rules:
- Each command runs in a new `bash -c` subshell started in the repository root: `cd` and variables
  do not carry over, so chain commands with `&&` when needed.
- Commands must not be interactive and must finish within {{timeout:g}} seconds. Do not leave
  processes running in the background.
- Edit files with shell tools (sed, python scripts, `cat <<'EOF' > file`).
- Change only non-test source files. The repository's tests are restored before your work is graded.
- When you are done, submit by running `echo {SUBMIT_SENTINEL}` as a command of its own.
  Your changes on disk are what is graded."""

USER_TEMPLATE = """Resolve this issue in the repository in your current directory:

<issue>
{problem_statement}
</issue>

A good workflow: find the relevant code, reproduce the problem with a small script, fix the source,
check the fix and edge cases, then submit."""


def task_messages(row: dict, command_timeout: float) -> list[dict]:
    """The episode's first window: system prompt and the issue (problem_statement only, as the
    leaderboard rules ask)."""
    task = USER_TEMPLATE.format(problem_statement=row["problem_statement"].strip())
    return [{"role": "system", "content": SYSTEM_PROMPT.format(timeout=command_timeout)},
            {"role": "user", "content": task}]


def check_prompts_fit(rows: list[dict], codec, context_budget: int, reserve: int, command_timeout: float) -> None:
    """Every task's first window must leave the reserve free (eq. 7), or its episode ends before
    its first action (context_overflow) and nothing is learned. ValueError naming the longest
    task and the --context-budget it needs; `codec` is the policy's model.ChatCodec."""
    lengths = {r["instance_id"]: len(codec.prompt(task_messages(r, command_timeout))) for r in rows}
    longest = max(lengths, key=lengths.get)
    if (need := lengths[longest] + reserve) > context_budget:
        raise ValueError(f"the first prompt of task {longest} (system prompt and issue) is {lengths[longest]} "
                         f"tokens; with the reserve kept free for an action (--reserve {reserve}, eq. 7) it "
                         f"needs --context-budget {need} or more, but --context-budget is {context_budget}")


class SWEEnv:
    """One task episode: a sandbox of the row's repository, graded by `grade` on a fresh one."""

    def __init__(self, row: dict, sandbox_factory: SandboxFactory, *, command_timeout: float = 60.0,
                 eval_timeout: float = HARNESS_TIMEOUT, attempts: int = 3):
        self.row, self.sandbox_factory = row, sandbox_factory
        self.command_timeout, self.eval_timeout, self.attempts = command_timeout, eval_timeout, attempts
        self.sandbox: Sandbox | None = None
        self.done = False
        self.last_grade: dict | None = None   # the report behind the last reward(), for logs

    def reset(self) -> list[dict]:
        self.close()
        self.sandbox = retry(lambda: self.sandbox_factory(self.row), self.attempts,
                             f"{self.row['instance_id']}: starting a sandbox")
        self.done, self.last_grade = False, None
        return task_messages(self.row, self.command_timeout)

    def step(self, action_text: str) -> Step:
        sandbox = self._live_sandbox()
        if self.done:
            raise RuntimeError(f"{self.row['instance_id']}: the episode is over (submitted); call reset()")
        command, error = parse_action(action_text)
        if error is not None:
            return Step(observation=error, done=False, format_error=True)
        result = sandbox.run(command, self.command_timeout)
        self.done = is_submission(result.output)
        return Step(observation=format_observation(result), done=self.done)

    def diff(self) -> str:
        return self._live_sandbox().diff()

    def reward(self) -> float:
        """1.0 if the sandbox's diff resolves the task, else 0.0 (see `grade`)."""
        try:
            patch = self.diff()
        except DiffError as e:   # the agent broke the repository's git state: no patch, no reward
            logger.warning("%s: no patch, reward 0: %s", self.row["instance_id"], e)
            self.last_grade = {"instance_id": self.row["instance_id"], "resolved": False,
                               "patch_applied": False, "tests_status": None, "log": str(e)}
            return 0.0
        self.last_grade = retry(lambda: grade(self.row, patch, self.sandbox_factory, self.eval_timeout),
                                self.attempts, f"{self.row['instance_id']}: grading")
        return float(self.last_grade["resolved"])

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None

    def _live_sandbox(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError(f"{self.row['instance_id']}: no sandbox; call reset() first")
        return self.sandbox
