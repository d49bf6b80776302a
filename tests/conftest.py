"""Markers by directory, so that a tier's tests need no decorator each, and the GPU opt-in.

``slow`` and ``htcondor`` select the tiers the fast subset leaves out
(``pytest -m "not slow and not htcondor"``, README "Development"):

* ``tests/process``: migd and the wrapper as real processes, with real sockets,
  signals and timeouts (seconds per test): ``slow``.
* ``tests/integration``: the real HTCondor pool; its own conftest marks each test
  ``htcondor``.

Elsewhere a test is marked ``slow`` where it is defined, with the reason. A test marked
``gpu`` needs a real NVIDIA GPU and runs only with ``MIGD_GPU_TESTS=1``.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType

import pytest
from hypothesis import HealthCheck, settings

TESTS = Path(__file__).resolve().parent
SLOW_DIRECTORIES = ("process",)
GPU_OPT_IN = "MIGD_GPU_TESTS"

# Hypothesis judges each example by the host's speed (200 ms deadline, a "too slow" health
# check on generation): on a 2-core host beside other work (load 15) that failed tests whose
# properties held. The properties are the test; their speed is bench/'s to measure.
settings.register_profile("migd", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "migd"))


def apply_markers(
    items: Sequence[pytest.Item], root: Path = TESTS, environ: Mapping[str, str] = os.environ
) -> None:
    slow = {root / name for name in SLOW_DIRECTORIES}
    for item in items:
        if slow & set(item.path.parents):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and environ.get(GPU_OPT_IN) != "1":
            item.add_marker(pytest.mark.skip(reason=f"needs a real GPU: set {GPU_OPT_IN}=1"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    apply_markers(items)


def _terminated(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"terminated by signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (CI cancelling, scripts/test.sh stopping the chroot tier after a failed lint)
    # ends the run as Ctrl-C does, so fixtures are torn down: the chroot tier's pools are
    # stopped and its mounts undone, instead of left behind for the next run to find.
    signal.signal(signal.SIGTERM, _terminated)


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Host processes a test starts to stand in for lease holders and CUDA processes
    (``sleep``); every one is killed after the test."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()
