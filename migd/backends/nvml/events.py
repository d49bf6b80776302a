"""GPU health from NVML events: XID critical errors (and ECC) per GPU and MIG instance.

NVML delivers events through an event set (``nvml.h`` in NVIDIA/go-nvml, "Event Handling
Methods"): ``nvmlEventSetCreate``, ``nvmlDeviceRegisterEvents(device, types, set)`` per GPU
(types a GPU does not support are refused with NOT_SUPPORTED, so the mask is narrowed with
``nvmlDeviceGetSupportedEventTypes`` first), then ``nvmlEventSetWait_v2(set, timeout_ms)``,
which returns one ``nvmlEventData_t`` or TIMEOUT. The event data (``nvml.h``):

* ``eventType``: ``nvmlEventTypeXidCriticalError`` (0x8), ``...DoubleBitEccError`` (0x2),
  ``...SingleBitEccError`` (0x1), ``...PState`` (0x4), ``...Clock`` (0x10),
  ``...PowerSourceChange`` (0x80), ``nvmlEventMigConfigChange`` (0x100);
* ``eventData``: the XID for XID events ("999 for unknown xid error"), else 0;
* ``gpuInstanceId``/``computeInstanceId``: "If MIG is enabled and [the XID] event is
  attributable to a GPU instance [compute instance], stores a valid ... ID", else
  0xFFFFFFFF.

What migd does with them (:func:`classify`), following NVIDIA's k8s-device-plugin and
HAMi (``pkg/device-plugin/nvidiadevice/nvinternal/rm/health.go``):

* An XID in ``health.ignore_xids`` is an application fault, not a failing GPU: 13
  (graphics engine exception), 31 (GPU memory page fault), 43 (GPU stopped processing),
  45 (preemptive cleanup), 68 (video processor exception) come from the job's own code or
  its exit (HAMi's ``applicationErrorXids``); NVIDIA's k8s-device-plugin adds 109 (context
  switch timeout) to the same list. They are counted (``critical="false"``) and logged,
  nothing more.
* Any other XID, and a double-bit ECC error, is critical: the GPU gets no new leases.
* NVIDIA's Xid catalog (docs.nvidia.com/deploy/xid-errors, "Resolution Bucket") lists XIDs
  after which the GPU must be reset or the node rebooted: 48 (double-bit ECC), 79 (GPU has
  fallen off the bus), 95 (uncontained ECC error), 119 and 120 (GSP errors). migd treats
  those, and a double-bit ECC event (HAMi registers it but acts on XIDs only; a DBE
  also raises XID 48), as losing every instance on the GPU; a critical XID that NVML
  attributes to a GPU instance loses that instance's work only. Either way the whole GPU
  takes no new leases, where HAMi marks only the attributed MIG device: migd repartitions
  GPUs itself, so the failing slices would go to the next job in another instance.
* Single-bit ECC (corrected by hardware), PState, clock and power-source events are
  not health signals and are not registered. Neither are MIG configuration changes:
  migd's own creates and destroys cause one each, and migd re-reads a GPU's instances
  whenever its own work fails (:func:`classify` still names them, for callers that do
  register them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any

import structlog

from migd.ports import GpuEvent

log = structlog.get_logger("migd.nvml_events")

# nvml.h (NVIDIA/go-nvml gen/nvml/nvml.h), "Event Types".
EVENT_SINGLE_BIT_ECC = 0x1
EVENT_DOUBLE_BIT_ECC = 0x2
EVENT_PSTATE = 0x4
EVENT_XID_CRITICAL = 0x8
EVENT_CLOCK = 0x10
EVENT_POWER_SOURCE = 0x80
EVENT_MIG_CONFIG_CHANGE = 0x100
#: What migd listens for.
WANTED_EVENTS = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC
#: nvmlEventData_t: gpuInstanceId/computeInstanceId when not attributable.
NOT_ATTRIBUTED = 0xFFFFFFFF
#: nvmlEventData_t.eventData "is set as 999 for unknown xid error".
UNKNOWN_XID = 999
# nvml.h return codes used here.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_TIMEOUT = 10

#: HAMi's (and NVIDIA k8s-device-plugin's) application-fault XIDs.
APPLICATION_XIDS = (13, 31, 43, 45, 68, 109)
#: XIDs after which NVIDIA's Xid catalog says the GPU needs a reset or the node a reboot.
GPU_LOST_XIDS = frozenset({48, 79, 95, 119, 120})
#: Short descriptions for logs and status (NVIDIA's Xid catalog); others say "XID n".
XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    999: "unknown XID",
}


def _instance_id(value: int) -> int | None:
    return None if value == NOT_ATTRIBUTED else int(value)


def classify(
    gpu: int,
    event_type: int,
    data: int,
    gi_id: int = NOT_ATTRIBUTED,
    ci_id: int = NOT_ATTRIBUTED,
    *,
    ignore_xids: Collection[int] = APPLICATION_XIDS,
) -> GpuEvent | None:
    """What an ``nvmlEventData_t`` means for migd (see the module docstring); None for
    events that say nothing about health."""
    gi, ci = _instance_id(gi_id), _instance_id(ci_id)
    where = f"GPU {gpu}" + (f" GPU instance {gi}" if gi is not None else "")
    if event_type & EVENT_XID_CRITICAL:
        xid = int(data)
        name = XID_NAMES.get(xid, f"XID {xid}")
        if xid in ignore_xids:
            return GpuEvent(
                gpu,
                "xid",
                xid,
                gi,
                ci,
                critical=False,
                reason=f"XID {xid} ({name}) on {where}: an application fault, GPU kept in service",
            )
        lost = xid in GPU_LOST_XIDS or gi is not None
        gpu_wide = xid in GPU_LOST_XIDS
        return GpuEvent(
            gpu,
            "xid",
            xid,
            None if gpu_wide else gi,
            None if gpu_wide else ci,
            critical=True,
            instance_lost=lost,
            reason=f"XID {xid} ({name}) on {where}",
        )
    if event_type & EVENT_DOUBLE_BIT_ECC:
        return GpuEvent(
            gpu,
            "ecc_dbe",
            critical=True,
            instance_lost=True,
            reason=f"double-bit (uncorrectable) ECC error on GPU {gpu}",
        )
    if event_type & EVENT_MIG_CONFIG_CHANGE:
        return GpuEvent(gpu, "mig_config", reason=f"MIG configuration changed on GPU {gpu}")
    return None


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


class NvmlEventListener:
    """A thread that waits on one NVML event set for the given GPUs.

    Args:
        nvml: a ``pynvml``-compatible module (or the simulated one with events,
            :mod:`migd.backends.simulated.nvml_events`); the listener is its own NVML
            client (``nvmlInit``/``nvmlShutdown``).
        gpus: NVML indices to listen on.
        on_event: called in the listener's thread with each classified event.
        ignore_xids: application-fault XIDs (``health.ignore_xids``).
        wait_ms: how long one wait blocks; bounds how long :meth:`stop` takes.
    """

    def __init__(
        self,
        nvml: Any,
        gpus: Iterable[int],
        on_event: Callable[[GpuEvent], None],
        *,
        ignore_xids: Collection[int] = APPLICATION_XIDS,
        wait_ms: int = 500,
    ) -> None:
        self.nvml = nvml
        self.gpus = list(gpus)
        self.on_event = on_event
        self.ignore_xids = frozenset(ignore_xids)
        self.wait_ms = wait_ms
        self.registered: dict[int, int] = {}  # GPU index -> event mask registered
        self.unsupported: dict[int, str] = {}  # GPU index -> why it has no events
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._set: Any = None
        self._index_of: dict[int, int] = {}  # handle address -> GPU index

    def start(self) -> None:
        """Register the GPUs and start waiting. NVML errors while registering leave that
        GPU without events (logged), never stop the daemon."""
        nvml = self.nvml
        nvml.nvmlInit()
        self._set = nvml.nvmlEventSetCreate()
        for index in self.gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                mask = supported & WANTED_EVENTS
                if not mask & (EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC):
                    self.unsupported[index] = "the GPU reports no XID or ECC events"
                    continue
                nvml.nvmlDeviceRegisterEvents(handle, mask, self._set)
            except Exception as exc:  # NVMLError and friends: that GPU goes without
                self.unsupported[index] = f"cannot register NVML events: {exc}"
                continue
            self.registered[index] = mask
            self._index_of[_address(handle)] = index
        for index, why in self.unsupported.items():
            log.warning("nvml_events.unsupported", gpu=index, reason=why)
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(1.0, 4 * self.wait_ms / 1000))
        if self._set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._set)
                self.nvml.nvmlShutdown()
            except Exception as exc:  # the driver may be gone; nothing to keep
                log.info("nvml_events.free_failed", error=str(exc))
            self._set = None

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                data = self.nvml.nvmlEventSetWait_v2(self._set, self.wait_ms)
            except Exception as exc:
                if _code(exc) == NVML_ERROR_TIMEOUT:
                    failures = 0
                    continue
                failures += 1
                log.warning("nvml_events.wait_failed", error=str(exc), failures=failures)
                # A driver that keeps failing must not spin a core; the GPU's own NVML
                # calls (and the watchdog) report it.
                self._stop.wait(min(30.0, 0.5 * 2**failures))
                continue
            failures = 0
            self._deliver(data)

    def _deliver(self, data: Any) -> None:
        index = self._index_of.get(_address(data.device))
        if index is None:
            log.warning("nvml_events.unknown_device", event_type=int(data.eventType))
            return
        event = classify(
            index,
            int(data.eventType),
            int(data.eventData),
            int(getattr(data, "gpuInstanceId", NOT_ATTRIBUTED)),
            int(getattr(data, "computeInstanceId", NOT_ATTRIBUTED)),
            ignore_xids=self.ignore_xids,
        )
        if event is None:
            return
        try:
            self.on_event(event)
        except Exception as exc:  # the daemon's handler must not kill the listener
            log.exception("nvml_events.handler_failed", error=str(exc), **event.to_dict())


class NvmlEvents:
    """The :class:`migd.ports.GpuEvents` port over a ``pynvml``-compatible module: each
    listener is its own NVML client of it."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def listener(
        self,
        gpus: Iterable[int],
        on_event: Callable[[GpuEvent], None],
        *,
        ignore_xids: Collection[int],
    ) -> NvmlEventListener:
        return NvmlEventListener(self.nvml, gpus, on_event, ignore_xids=ignore_xids)


def nvml_events() -> NvmlEvents | None:
    """The port over the real bindings; None without them (the NVML backend reports that)."""
    try:
        import pynvml
    except ImportError:
        return None
    return NvmlEvents(pynvml)


def _address(handle: Any) -> int:
    """A device handle's identity: the pointer's address (pynvml handles are ctypes
    pointers; two handles for one GPU carry the same address)."""
    import ctypes

    try:
        return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)
    except (TypeError, ctypes.ArgumentError):
        return id(handle)
