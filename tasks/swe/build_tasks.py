"""Builds tasks/swe/tasks.jsonl, the built-in SWE tasks, from the task folders next to this file.

    python -m tasks.swe.build_tasks            # from the repository root: rewrite tasks.jsonl
    python -m tasks.swe.build_tasks --check    # exit 1 if tasks.jsonl is out of date

Each folder `<name>/` holds:
  repo/                 the buggy repository as plain files (visible tests included)
  problem_statement.md  what the agent is told
  gold.patch            the reference fix (unified diff, `git apply`-able at the base commit)
  test.patch            the hidden tests (changes only test files)
  task.json             {"instance_id", "FAIL_TO_PASS", "PASS_TO_PASS"}, pytest ids as `-rA` prints them

Rows follow the swebench-5 schema. `base_commit` is the commit `sandbox.commit_base` makes of repo/
(fixed author and date, so it is reproducible); `LocalSandbox` checks it, so a row goes stale
(loudly) when its repository changes. Each row runs two ways: in a `LocalSandbox` copy of
`repo_dir` (relative to this folder), or in a container of `image`, the name swebench gives a
locally built instance image, which tasks/swe/build_images.py builds (the repository at
/testbed, the working folder, at base_commit). The eval script has the shape of SWE-bench
Verified's (reset the test files, apply the test patch, markers around a `pytest -rA` run, reset
again) minus `cd /testbed` and conda activation: it runs in the working folder (the container's
/testbed, or the sandbox's copy) with the python found there. tests/test_swe_task.py checks
that every gold patch resolves its task and that the tests fail without it.
"""
import json
import os
import re
import shutil
import sys
import tempfile

from sandbox import COPY_IGNORE, commit_base
from swe_task import image_name

TASKS_DIR = os.path.dirname(os.path.abspath(__file__))
TASKS_FILE = os.path.join(TASKS_DIR, "tasks.jsonl")


def base_commit_of(repo_dir: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, "repo")
        shutil.copytree(repo_dir, copy, symlinks=True, ignore=COPY_IGNORE)   # as LocalSandbox copies it
        return commit_base(copy)


def files_of(patch: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.MULTILINE)


def eval_script(base_commit: str, test_patch: str) -> str:
    test_files = " ".join(files_of(test_patch))
    return "\n".join([
        "#!/bin/bash",
        "set -uxo pipefail",
        "git status",
        f"git diff {base_commit}",
        f"git checkout {base_commit} {test_files}",   # undo the agent's edits of the graded tests
        "git apply -v - <<'EOF_HIDDEN_TESTS'",
        test_patch.rstrip("\n"),
        "EOF_HIDDEN_TESTS",
        ": '>>>>> Start Test Output'",
        # no third-party plugins (our venv's anyio/typeguard ones cost ~0.6 s a run; these repos need none)
        f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider {test_files}",
        ": '>>>>> End Test Output'",
        f"git checkout {base_commit} {test_files}",
        "",
    ])


def build_row(name: str) -> dict:
    folder = os.path.join(TASKS_DIR, name)
    read = lambda file: open(os.path.join(folder, file), encoding="utf-8").read()  # noqa: E731
    meta, test_patch = json.loads(read("task.json")), read("test.patch")
    base = base_commit_of(os.path.join(folder, "repo"))
    return {
        "instance_id": meta["instance_id"],
        "repo": f"local/{name}",
        "base_commit": base,
        "problem_statement": read("problem_statement.md"),
        "patch": read("gold.patch"),
        "test_patch": test_patch,
        "FAIL_TO_PASS": meta["FAIL_TO_PASS"],
        "PASS_TO_PASS": meta["PASS_TO_PASS"],
        "version": "0.1",
        "image": image_name(meta["instance_id"], namespace=None),
        "eval_script": eval_script(base, test_patch),
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "repo_dir": f"{name}/repo",
    }


def build_rows() -> list[dict]:
    names = sorted(os.listdir(TASKS_DIR))
    return [build_row(name) for name in names if os.path.isfile(os.path.join(TASKS_DIR, name, "task.json"))]


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    text = render(build_rows())
    if "--check" in sys.argv[1:]:
        current = open(TASKS_FILE, encoding="utf-8").read() if os.path.exists(TASKS_FILE) else ""
        sys.exit(0 if current == text else f"{TASKS_FILE} is stale: run python -m tasks.swe.build_tasks")
    with open(TASKS_FILE, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {TASKS_FILE}")
