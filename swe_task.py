"""SWE tasks: swebench-5 rows, the agent's environment, and grading with swebench's own code.

A task is one row in the swebench-5 schema (`REQUIRED_FIELDS`): the official SWE-bench Verified
rows and our built-in toy tasks (tasks/swe/, built by tasks/swe/build_tasks.py) are the same
shape. Built-in rows have `image == "local"` and a `repo_dir` (relative to the tasks file) that
plays the role of the image: a `LocalSandbox` copies it; official rows run in a `DockerSandbox`.

Episode: `reset()` -> system + user messages; `step(action)` runs one fenced command
(env.parse_action) in the sandbox; the sentinel ends it; `reward()` grades the sandbox's diff.

Grading (`grade`) follows the official harness (swebench.harness.run_evaluation.run_instance)
minus its logging, caching and containers-by-run-id: the patch, taken from the sandbox with git
and never from the model's text, is applied to a FRESH sandbox of the base repository with the
harness's fallback chain; the eval script of `make_test_spec(row)` (so the exit-code recording
and markers are the official ones) runs there; swebench's `get_eval_report` grades the log.
Reward 1 only when every FAIL_TO_PASS and PASS_TO_PASS test passes. Departures: an empty patch
is not run (as in the harness) but graded unresolved here rather than skipped; the harness's
final "already applied?" check is dropped (a patch from a clean base cannot be); a local row's
eval script has no `cd /testbed` and runs in the sandbox's working copy.
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
from swebench.harness.utils import make_test_spec

from env import SUBMIT_SENTINEL, Step, format_observation, is_submission, parse_action
from sandbox import DiffError, DockerSandbox, LocalSandbox, Sandbox, SandboxError

logger = logging.getLogger(__name__)

PROJECT_DIR = os.path.dirname(os.path.abspath(__file__))
BUILTIN_TASKS_DIR = os.path.join(PROJECT_DIR, "tasks", "swe")
BUILTIN_TASKS_FILE = os.path.join(BUILTIN_TASKS_DIR, "tasks.jsonl")
LOCAL_IMAGE = "local"   # `image` of rows that run in a LocalSandbox of `repo_dir`, not in a container
REQUIRED_FIELDS = {
    "instance_id": str, "repo": str, "base_commit": str, "problem_statement": str, "patch": str,
    "test_patch": str, "FAIL_TO_PASS": list, "PASS_TO_PASS": list, "version": str, "image": str,
    "eval_script": str, "log_parser": str, "eval_type": str,
}
# The official harness's order (run_instance): strict first, then 3-way, reject, and fuzzy `patch`.
APPLY_COMMANDS = ("git apply --verbose", "git apply --verbose --3way", "git apply --verbose --reject",
                  "patch --batch --forward --fuzz=5 -p1 -i")
EVAL_MAX_OUTPUT_BYTES = 16 * 1024 * 1024   # a test log, head and tail kept (the -rA summary is at the end)
SandboxFactory = Callable[[dict], Sandbox]


# ---------------------------------------------------------------- rows

def validate_row(row: dict, index: int) -> dict:
    """Checks one row; returns a copy with FAIL_TO_PASS/PASS_TO_PASS as lists.

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
    if row["image"] == LOCAL_IMAGE and not isinstance(row.get("repo_dir"), str):
        fail("repo_dir", f"is required (a folder, relative to the tasks file) when image is {LOCAL_IMAGE!r}")
    return row


def load_tasks(path: str = BUILTIN_TASKS_FILE) -> list[dict]:
    """Reads and validates rows from .jsonl, .json (a list) or .parquet (needs pandas).

    `repo_dir` of local rows is made absolute, relative to the file's folder. An empty file or a
    line that is not JSON raises ValueError naming the file (and the line).
    """
    if path.endswith(".jsonl"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):  # 1-based, blank lines counted: what an editor shows
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line.rstrip("\n")))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}, line {number}, column {e.colno}: not valid JSON ({e.msg})") from e
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: expected a JSON list of task rows, got {type(rows).__name__}")
    elif path.endswith(".parquet"):
        import pandas  # optional: only parquet needs it
        rows = pandas.read_parquet(path).to_dict(orient="records")
        for row in rows:   # list columns come back as numpy arrays
            row.update({k: v.tolist() for k, v in row.items() if hasattr(v, "tolist")})
    else:
        raise ValueError(f"{path}: task files must be .jsonl, .json or .parquet")
    if not rows:
        raise ValueError(f"{path} holds no task rows")
    rows = [validate_row(row, i) for i, row in enumerate(rows)]
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        if (first := seen.setdefault(row["instance_id"], i)) != i:
            raise ValueError(f"{path}: task rows {first} and {i} share instance_id {row['instance_id']!r}")
        if row["image"] == LOCAL_IMAGE:
            row["repo_dir"] = os.path.join(os.path.dirname(os.path.abspath(path)), row["repo_dir"])
            if not os.path.isdir(row["repo_dir"]):
                raise ValueError(f"task row {i} (instance_id={row['instance_id']!r}): field 'repo_dir' "
                                 f"points to {row['repo_dir']}, which is not a folder")
    return rows


# ---------------------------------------------------------------- sandboxes per row

def local_sandbox_factory(**kwargs) -> SandboxFactory:
    """Local rows: a LocalSandbox of `repo_dir` at `base_commit` (kwargs go to LocalSandbox). The
    sandbox shows commands nothing of this project (its task files and git history hold the gold
    patches) but our venv."""
    def make(row: dict) -> Sandbox:
        if row["image"] != LOCAL_IMAGE:
            raise ValueError(f"{row['instance_id']}: image {row['image']!r} needs a docker sandbox factory")
        return LocalSandbox(row["repo_dir"], row["base_commit"], **kwargs)
    return make


def docker_sandbox_factory(**kwargs) -> SandboxFactory:
    """Official rows: a container of `image` (kwargs go to DockerSandbox)."""
    return lambda row: DockerSandbox(row["image"], row["base_commit"], **kwargs)


# ---------------------------------------------------------------- grading

def apply_patch(sandbox: Sandbox, patch: str, timeout: float = 120.0) -> tuple[bool, str]:
    """Tries APPLY_COMMANDS in order, resetting the tree between tries; returns (applied, log)."""
    path, log = sandbox.write_file("patch.diff", patch), []
    for attempt, command in enumerate(APPLY_COMMANDS):
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


def grade(row: dict, patch: str, sandbox_factory: SandboxFactory, timeout: float = 300.0) -> dict:
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


class SWEEnv:
    """One task episode: a sandbox of the row's repository, graded by `grade` on a fresh one."""

    def __init__(self, row: dict, sandbox_factory: SandboxFactory, *, command_timeout: float = 60.0,
                 eval_timeout: float = 300.0, attempts: int = 3):
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
        task = USER_TEMPLATE.format(problem_statement=self.row["problem_statement"].strip())
        return [{"role": "system", "content": SYSTEM_PROMPT.format(timeout=self.command_timeout)},
                {"role": "user", "content": task}]

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
