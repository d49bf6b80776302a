"""Fixtures for the backend tests: a simulated node whose back-off waits are recorded."""

from __future__ import annotations

from typing import Any

import pytest
from sim_support import Sim, SleepRecorder

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import SimNode, simulated_backend


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
def sim(sleeps: SleepRecorder) -> Sim:
    """``sim("1xA100-40GB", **node_options) -> (backend, node)`` with recorded back-off."""

    def make(description: Any, **options: Any) -> tuple[NvmlBackend, SimNode]:
        return simulated_backend(description, sleep=sleeps, **options)

    return make
