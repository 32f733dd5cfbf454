"""Shared pytest set-up: the repository root on sys.path and one torch thread per process
(the CI machines are shared; two-thread runs slow down 10-30x when a neighbour is busy)."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)


import functools  # noqa: E402

import pytest  # noqa: E402


REQUIRE_BWRAP = os.environ.get("COMPACTIONRL_TEST_REQUIRE_BWRAP") == "1"   # .ci/run sets it


@functools.lru_cache(maxsize=None)
def bwrap_isolates() -> bool:
    """Whether local sandboxes isolate here. Where COMPACTIONRL_TEST_REQUIRE_BWRAP=1 (CI), a
    sandbox that cannot isolate is an error, so no escape test is skipped unseen."""
    from sandbox import SandboxError, check_isolation
    try:
        check_isolation()
        return True
    except SandboxError:
        if REQUIRE_BWRAP:
            raise
        return False


@pytest.fixture(scope="session")
def sandbox_kwargs():
    """LocalSandbox options for tests that run only our own harmless commands: isolated where
    bubblewrap works, else explicitly not. Escape attempts never use this: they require isolation
    and skip without it."""
    return {} if bwrap_isolates() else {"isolated": False}


REQUIRE_DOCKER = os.environ.get("COMPACTIONRL_TEST_REQUIRE_DOCKER") == "1"   # .ci/run sets it


def require_docker_images(images):
    """Skips the calling test unless a Docker daemon answers and holds every image in `images`
    (tests never pull: the built-in tasks' images come from tasks/swe/build_images.py). Where
    COMPACTIONRL_TEST_REQUIRE_DOCKER=1 (CI), a missing daemon or image fails the test instead, so
    no Docker test is skipped unseen."""
    from sandbox import SandboxError, check_docker_images
    try:
        check_docker_images(list(images))
    except SandboxError as e:
        (pytest.fail if REQUIRE_DOCKER else pytest.skip)(str(e))


REQUIRE_CHROMIUM = os.environ.get("COMPACTIONRL_TEST_REQUIRE_CHROMIUM") == "1"   # .ci/run sets it


def require_chromium():
    """The path of a Chromium to drive headless (tests/browser.py). Skips the calling test without
    one, except where COMPACTIONRL_TEST_REQUIRE_CHROMIUM=1 (CI), where that fails it."""
    from browser import find_chromium
    path = find_chromium()
    if path is None:
        (pytest.fail if REQUIRE_CHROMIUM else pytest.skip)(
            "no chromium on PATH: `apt-get install chromium` (Debian's) to render report.html in the tests")
    return path
