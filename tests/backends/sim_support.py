"""Helpers shared by the backend tests (a uniquely named module: tests import it directly)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import SimNode

DATA = Path(__file__).resolve().parent.parent / "data"


class SleepRecorder:
    """Stands in for ``time.sleep``: records the waits instead of waiting."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


Sim = Callable[..., tuple[NvmlBackend, SimNode]]
