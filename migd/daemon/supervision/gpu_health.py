"""GPU health from NVML events, applied to the daemon's books (docs/operations.md, GPU health).

:class:`GpuHealthMonitor` runs a listener of the :class:`~migd.ports.GpuEvents` port
(built in ``main()``: NVML's, or the simulated node's) and applies each event on the
event loop:

* every XID is counted (``migd_gpu_xid_events_total``), logged and recorded in the history;
* a critical one (not an application fault) raises the GPU's ``xid`` health condition: the
  GPU takes no new leases, `migctl status` and the slot ads (``MigdGpuHealthy``,
  ``MigdGpuReason``) say why, and the leases running on it are flagged (their ``warning``,
  shown by `migctl leases`/`explain`);
* where the event means the work is lost (an XID NVML attributes to a GPU instance, or one
  after which the GPU needs a reset), each affected lease gets the typed end reason
  ``gpu_lost`` (:class:`~migd.core.lease_end.LeaseEndReason`) while it is still active:
  the wrapper, which watches the lease, stops the job and has HTCondor run it again
  with the warning as the reason (docs/wrapper.md, "When migd takes the lease back").

The condition stays until migd restarts: an XID is an edge, not a state, and NVIDIA's
recovery for the critical ones (GPU reset, reboot, replacement) restarts migd anyway. An
admin who judges a GPU fine can clear it with `migctl resume` (see :meth:`clear`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import structlog

from migd.core.gpus import ManagedGpu
from migd.core.health import HealthSource
from migd.core.lease_end import LeaseEndReason
from migd.core.leases import Lease
from migd.daemon.context import DaemonContext
from migd.daemon.leases.service import LeaseService
from migd.daemon.metrics.service import MetricsService
from migd.errors import MigdError
from migd.ports import EventListener, GpuEvent, GpuEvents

log = structlog.get_logger("migd.health")

#: The health source of XID conditions (the agreed GpuHealth interface).
SOURCE = HealthSource.XID


def raise_condition(gpu: ManagedGpu, reason: str, now_s: float) -> None:
    """Raise the GPU's ``xid`` condition (other sources' conditions stay)."""
    gpu.health.raise_(SOURCE, reason, now_s)


def clear_condition(gpu: ManagedGpu) -> bool:
    """Clear the GPU's ``xid`` condition; True if it had one."""
    return gpu.health.clear(SOURCE)


class GpuHealthMonitor:
    """Listens for NVML events and applies them (see the module docstring).

    Args:
        ctx: the daemon's shared state.
        leases: persists flagged leases and records history.
        metrics: counts the events.
        events: NVML's event stream; None where there is none (no bindings).
    """

    def __init__(
        self,
        ctx: DaemonContext,
        leases: LeaseService,
        metrics: MetricsService,
        events: GpuEvents | None = None,
    ) -> None:
        self.ctx = ctx
        self.leases = leases
        self.metrics = metrics
        self.source = events
        self.listener: EventListener | None = None
        self.events: list[GpuEvent] = []  # every event applied, newest last (bounded)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        cfg = self.ctx.config.health
        if not cfg.xid_events or self.source is None:
            return
        self._loop = asyncio.get_running_loop()
        self.listener = self.source.listener(
            [g.index for g in self.ctx.gpus],
            self._from_listener,
            ignore_xids=cfg.ignore_xids,
        )
        # Registering makes NVML calls: off the event loop.
        await self._loop.run_in_executor(None, self.listener.start)
        log.info(
            "health.listening",
            gpus=sorted(self.listener.registered),
            without_events=self.listener.unsupported or None,
            ignore_xids=cfg.ignore_xids,
        )

    # -- event observer (migd.daemon.leases.service.EventObserver) ---------------------------

    def lease_refused(self, error: MigdError) -> None:
        pass

    def recorded(self, event: str, lease: Lease | None, data: Mapping[str, Any]) -> None:
        """`migctl resume GPU` clears the GPU's xid condition as well as its drain."""
        if event == "resume" and isinstance(data.get("gpu"), int):
            self.clear(data["gpu"])

    def stop(self) -> None:
        if self.listener is not None:
            self.listener.stop()
            self.listener = None

    def _from_listener(self, event: GpuEvent) -> None:
        """In the listener's thread: hand the event to the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.apply, event)

    def apply(self, event: GpuEvent) -> list[Lease]:
        """Apply one event to the books; returns the leases it flagged."""
        ctx = self.ctx
        now = ctx.clock.now()
        self.events = [*self.events[-99:], event]
        if event.xid is not None:
            self.metrics.recorder.xid(event.gpu, event.xid, event.critical)
        self.leases.record("gpu.event", None, **event.to_dict())
        gpu = ctx.sched.gpus.get(event.gpu)
        if not event.critical or gpu is None:
            log.info("gpu.event", **event.to_dict())
            return []
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now))
        reason = f"{event.reason} at {stamp}: no new leases on this GPU"
        raise_condition(gpu, reason, now)
        flagged = []
        for lease in ctx.sched.active_leases():
            if lease.gpu != event.gpu or not lease.state.holds_resources:
                continue
            lost = event.instance_lost and (event.gi_id is None or self._on_gi(gpu, lease, event))
            if event.gi_id is not None and not lost:
                continue  # another instance's fault: this lease's work goes on
            end = None
            if lost:
                # The words are for people (and for wrappers older than end_reason, which
                # look for them); the typed end reason is what the wrapper acts on.
                message = (
                    f"GPU lost: {event.reason}: the job's GPU work is lost; "
                    "HTCondor should run it again"
                )
                end = LeaseEndReason.GPU_LOST
            else:
                message = f"{event.reason}: the GPU takes no new leases; this lease is kept"
            lease.warn(message, now, end=end)
            self.leases.save(lease)
            flagged.append(lease)
        log.error(
            "gpu.unhealthy",
            **event.to_dict(),
            leases=[lease.lease_id for lease in flagged],
            jobs=[lease.request.job_id for lease in flagged],
            hint="see docs/operations.md (GPU health): drain the GPU in HTCondor too, "
            "reset or replace it, then restart migd",
        )
        return flagged

    @staticmethod
    def _on_gi(gpu: ManagedGpu, lease: Lease, event: GpuEvent) -> bool:
        """Whether the lease runs on the GPU instance NVML named."""
        for inst in gpu.instances:
            if inst.gi_id != event.gi_id:
                continue
            if inst.lease_id == lease.lease_id:
                return True
            if inst.uuid is not None and inst.uuid == lease.mig_uuid:  # MPS inside it
                return True
        return False

    def clear(self, index: int) -> bool:
        """An admin cleared the GPU (``migctl resume``): drop its xid condition."""
        gpu = self.ctx.sched.gpus.get(index)
        if gpu is None or not clear_condition(gpu):
            return False
        log.info("gpu.xid_cleared", gpu=index)
        # The GPU's health changed outside the scheduler's books: place what now fits.
        now, mono = self.ctx.now()
        self.leases.apply(self.ctx.sched.schedule(now, mono))
        return True
