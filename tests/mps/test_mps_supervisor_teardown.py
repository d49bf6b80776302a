"""The daemon's MPS supervisor leaves the teardown wait to the MPS manager (issue 13
defect 2): it hands over NVML's process list of the instance, nothing more."""

from __future__ import annotations

from collections.abc import Callable, Collection
from types import SimpleNamespace
from typing import Any

from migd.daemon.supervision.mps import MpsSupervisor
from migd.ports import GpuProcess

MIG = "MIG-0a1b2c3d-0000-4000-8000-0000000000c1"


class Backend:
    def __init__(self) -> None:
        self.asked: list[tuple[int, str | None]] = []

    def processes(self, gpu: int, mig_uuid: str | None = None) -> list[GpuProcess]:
        self.asked.append((gpu, mig_uuid))
        return [GpuProcess(pid=5150, used_mib=None, gpu=gpu, mig_uuid=mig_uuid, mps=False)]


class Mps:
    def __init__(self) -> None:
        self.seen: list[tuple[str, Collection[int]]] = []

    def stop_for_teardown(
        self, device_uuid: str, device_pids: Callable[[], Collection[int]]
    ) -> None:
        self.seen.append((device_uuid, device_pids()))


def supervisor(mps: Any, backend: Backend) -> MpsSupervisor:
    ctx: Any = SimpleNamespace(mps=mps, backend=backend)
    return MpsSupervisor(ctx, executor=None, leases=None)  # type: ignore[arg-type]


def test_the_supervisor_passes_the_instances_nvml_processes_to_the_manager() -> None:
    mps, backend = Mps(), Backend()
    supervisor(mps, backend).stop_before_destroy(2, MIG)
    assert mps.seen == [(MIG, [5150])]
    assert backend.asked == [(2, MIG)]


def test_nothing_to_stop_without_mps_or_a_mig_device() -> None:
    mps, backend = Mps(), Backend()
    supervisor(None, backend).stop_before_destroy(0, MIG)
    supervisor(mps, backend).stop_before_destroy(0, None)
    assert mps.seen == [] and backend.asked == []
