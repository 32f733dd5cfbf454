"""Docker images of the built-in SWE tasks in the SWE-bench layout, built here: nothing is pulled.

    python -m tasks.swe.build_images           # from the repository root, as root, with a Docker daemon

The base image is a minimal Debian (debootstrap from the apt mirror, `docker import`) holding
what the tasks' eval scripts run: bash, coreutils, git, patch, python3 (also as `python`) and
pytest. It is built once and kept in the daemon's storage under a tag that hashes its recipe
(`BASE_RECIPE`): later runs reuse it, a changed recipe builds a new one. Each task's image then
adds its repository at /testbed, committed at the row's `base_commit` (the same deterministic
commit a LocalSandbox makes), and is tagged with the row's `image`: the name the swebench harness
gives a locally built instance image, so the harness and DockerSandbox find it and build nothing.

The images differ from the official ones in two ways the harness does not see: no conda (the
eval scripts run Debian's python), and STOPSIGNAL SIGKILL: the harness stops its containers with
`docker stop --time=15`, and their PID 1, `tail -f /dev/null`, ignores SIGTERM, so each stop
would wait out the 15 s; nothing in these containers needs a graceful shutdown.
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from sandbox import COPY_IGNORE, commit_base
from swe_task import BUILTIN_TASKS_FILE, load_tasks

BASE_RECIPE = {"suite": "bookworm", "variant": "minbase",
               "packages": ["git", "patch", "python-is-python3", "python3", "python3-pytest"],
               "changes": ["ENV LANG=C.UTF-8", "WORKDIR /"]}
"""What the base image is made of; its hash names the image, so any change here rebuilds it."""
BASE_NAME = "compactionrl-swe-base"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
TASK_DOCKERFILE = """FROM {base}
COPY testbed /testbed
WORKDIR /testbed
STOPSIGNAL SIGKILL
"""


def base_image() -> str:
    """The base image's name: BASE_NAME tagged with a hash of BASE_RECIPE."""
    digest = hashlib.sha256(json.dumps(BASE_RECIPE, sort_keys=True).encode()).hexdigest()
    return f"{BASE_NAME}:{digest[:12]}"


def docker(*args: str, stdin=None, timeout: float = 900.0) -> str:
    """The docker CLI; RuntimeError with its stderr when it fails."""
    proc = subprocess.run(["docker", *args], stdin=stdin, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`docker {' '.join(args[:3])} ...` failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def build_base(name: str, mirror: str) -> None:
    """debootstrap BASE_RECIPE into a temporary folder and import it as `name` (needs root and
    the apt mirror)."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="swe-base-") as tmp:
        rootfs = os.path.join(tmp, "rootfs")
        argv = ["debootstrap", f"--variant={BASE_RECIPE['variant']}",
                f"--include={','.join(BASE_RECIPE['packages'])}", BASE_RECIPE["suite"], rootfs, mirror]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        shutil.rmtree(os.path.join(rootfs, "var", "cache", "apt", "archives"), ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        changes = [arg for change in BASE_RECIPE["changes"] for arg in ("--change", change)]
        try:
            docker("import", *changes, "-", name, stdin=tar.stdout)
        finally:
            tar.stdout.close()
            tar.wait()


def build_task_image(row: dict, base: str) -> None:
    """The image `row["image"]`: `base` plus the task's repository at /testbed, at base_commit."""
    with tempfile.TemporaryDirectory(prefix="swe-task-") as context:
        testbed = os.path.join(context, "testbed")
        shutil.copytree(row["repo_dir"], testbed, symlinks=True, ignore=COPY_IGNORE)
        commit = commit_base(testbed)
        if commit != row["base_commit"]:
            raise RuntimeError(f"{row['instance_id']}: its repository commits as {commit}, not the row's "
                               f"base_commit {row['base_commit']}: run python -m tasks.swe.build_tasks")
        with open(os.path.join(context, "Dockerfile"), "w") as f:
            f.write(TASK_DOCKERFILE.format(base=base))
        docker("build", "--network", "none", "-q", "-t", row["image"], context)   # no bridge needed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=BUILTIN_TASKS_FILE, help="task rows with repo_dir and image")
    parser.add_argument("--mirror", default=os.environ.get("DEBIAN_MIRROR", DEFAULT_MIRROR),
                        help="apt mirror for debootstrap (only when the base image is built)")
    args = parser.parse_args(argv)
    start, base = time.monotonic(), base_image()
    if image_exists(base):
        print(f"base image {base}: present, reused")
    else:
        print(f"base image {base}: building with debootstrap from {args.mirror} ...", flush=True)
        build_base(base, args.mirror)
        print(f"base image {base}: built in {time.monotonic() - start:.0f} s")
    for row in load_tasks(args.tasks):
        build_task_image(row, base)
        print(f"{row['image']}: built")
    print(f"images ready in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
