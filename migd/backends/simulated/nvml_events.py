"""NVML events on the simulated node: event sets, XID and ECC injection.

:class:`EventPynvml` is :class:`~migd.backends.simulated.fake_pynvml.FakePynvml` plus
pynvml's event-set calls, with ``nvml.h``'s contracts (NVIDIA/go-nvml ``gen/nvml/nvml.h``,
"Event Handling Methods"):

* ``nvmlEventSetCreate()`` -> a set; ``nvmlEventSetFree(set)``;
* ``nvmlDeviceGetSupportedEventTypes(device)`` -> the mask the GPU can deliver;
* ``nvmlDeviceRegisterEvents(device, eventTypes, set)``: NOT_SUPPORTED "if the platform
  does not support this feature or some of requested event types", INVALID_ARGUMENT for a
  bad device or set, GPU_IS_LOST for a GPU that fell off the bus;
* ``nvmlEventSetWait_v2(set, timeoutms)`` -> ``nvmlEventData_t``, or NVML_ERROR_TIMEOUT
  "if no event arrived in specified timeout"; events that arrive while nobody waits are
  kept (the driver queues them per set).

``nvmlEventData_t`` carries the GPU handle, the event type, the XID in ``eventData`` and the
GPU/compute instance ids, 0xFFFFFFFF when the event is not attributable to one.

Injection (:func:`events_for`(node).inject_xid / inject_ecc_dbe) is how tests, the
``sim_xid`` API op and ``health.sim_xids`` make a GPU fail. XID 79 ("GPU has fallen off the
bus", NVIDIA's Xid catalog) also loses the GPU on the node (:meth:`SimNode.lose_gpu`): every
later NVML call about it fails with GPU_IS_LOST and its CUDA processes fail, as on hardware.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from ctypes import POINTER, Structure, c_uint, c_ulonglong
from dataclasses import dataclass, field
from typing import Any

from migd.backends.nvml.events import NvmlEventListener
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.fake_pynvml import FakePynvml
from migd.backends.simulated.node import SimNode
from migd.ports import GpuEvent

# nvml.h "Event Types".
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeClock = 0x10
nvmlEventTypePowerSourceChange = 0x80
nvmlEventMigConfigChange = 0x100
#: What a simulated data-centre GPU delivers (no power-source events: no battery).
SUPPORTED_EVENTS = (
    nvmlEventTypeSingleBitEccError
    | nvmlEventTypeDoubleBitEccError
    | nvmlEventTypePState
    | nvmlEventTypeXidCriticalError
    | nvmlEventTypeClock
    | nvmlEventMigConfigChange
)
NOT_ATTRIBUTED = 0xFFFFFFFF
#: NVIDIA's Xid catalog: 79 = "GPU has fallen off the bus".
XID_FALLEN_OFF_BUS = 79


class struct_c_nvmlEventSet_t(Structure):
    pass  # opaque handle


c_nvmlEventSet_t = POINTER(struct_c_nvmlEventSet_t)


class c_nvmlEventData_t(Structure):
    """pynvml's ``c_nvmlEventData_t`` (nvml.h ``nvmlEventData_t``)."""

    _fields_ = (
        ("device", api.c_nvmlDevice_t),
        ("eventType", c_ulonglong),
        ("eventData", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    )


@dataclass
class _Pending:
    gpu: int
    event_type: int
    data: int
    gi_id: int
    ci_id: int


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # GPU index -> mask
    queue: deque[_Pending] = field(default_factory=deque)
    freed: bool = False


class SimEvents:
    """The node's event sources: every event set registered on it, and injection."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._cond = threading.Condition()
        self._sets: dict[int, _EventSet] = {}
        self._next = 0
        self.injected: list[dict[str, Any]] = []  # what was injected, for tests and status

    # -- injection --------------------------------------------------------------------------

    def inject_xid(
        self, gpu: int, xid: int, gi_id: int | None = None, ci_id: int | None = None
    ) -> int:
        """An XID critical error on GPU ``gpu`` (optionally attributed to a GPU/compute
        instance); returns how many event sets received it.

        Raises:
            ValueError: no such GPU, or no such GPU instance on it.
        """
        if not 0 <= gpu < len(self.node.gpus):
            raise ValueError(f"no GPU {gpu} on the simulated node ({len(self.node.gpus)} GPUs)")
        if gi_id is not None:
            with self.node.lock:
                if gi_id not in self.node.gpus[gpu].instances:
                    raise ValueError(f"GPU {gpu} has no GPU instance {gi_id}")
        if xid == XID_FALLEN_OFF_BUS:
            self.node.lose_gpu(gpu)
        self.injected.append({"gpu": gpu, "xid": xid, "gi_id": gi_id, "ci_id": ci_id})
        return self._post(
            _Pending(
                gpu,
                nvmlEventTypeXidCriticalError,
                xid,
                NOT_ATTRIBUTED if gi_id is None else gi_id,
                NOT_ATTRIBUTED if ci_id is None else ci_id,
            )
        )

    def inject_ecc_dbe(self, gpu: int) -> int:
        """A double-bit (uncorrectable) ECC error on GPU ``gpu``."""
        if not 0 <= gpu < len(self.node.gpus):
            raise ValueError(f"no GPU {gpu} on the simulated node")
        self.injected.append({"gpu": gpu, "ecc": "double_bit"})
        return self._post(
            _Pending(gpu, nvmlEventTypeDoubleBitEccError, 0, NOT_ATTRIBUTED, NOT_ATTRIBUTED)
        )

    def _post(self, event: _Pending) -> int:
        delivered = 0
        with self._cond:
            for es in self._sets.values():
                if not es.freed and es.registered.get(event.gpu, 0) & event.event_type:
                    es.queue.append(event)
                    delivered += 1
            self._cond.notify_all()
        return delivered

    # -- the event-set calls (EventPynvml forwards here) -------------------------------------

    def create(self) -> int:
        with self._cond:
            self._next += 1
            self._sets[self._next] = _EventSet()
            return self._next

    def register(self, set_id: int, gpu: int, mask: int) -> None:
        with self._cond:
            es = self._sets.get(set_id)
            if es is None or es.freed:
                raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
            es.registered[gpu] = es.registered.get(gpu, 0) | mask

    def wait(self, set_id: int, timeout_s: float) -> _Pending:
        with self._cond:
            es = self._sets.get(set_id)
            if es is None or es.freed:
                raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
            if not self._cond.wait_for(lambda: bool(es.queue) or es.freed, timeout_s):
                raise api.NVMLError(api.NVML_ERROR_TIMEOUT)
            if es.freed:
                raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
            return es.queue.popleft()

    def free(self, set_id: int) -> None:
        with self._cond:
            es = self._sets.pop(set_id, None)
            if es is None:
                raise api.NVMLError(api.NVML_ERROR_INVALID_ARGUMENT)
            es.freed = True
            self._cond.notify_all()


_EVENTS: weakref.WeakKeyDictionary[SimNode, SimEvents] = weakref.WeakKeyDictionary()
_EVENTS_LOCK = threading.Lock()


def events_for(node: SimNode) -> SimEvents:
    """The node's event sources (one per node, made on first use)."""
    with _EVENTS_LOCK:
        events = _EVENTS.get(node)
        if events is None:
            events = _EVENTS[node] = SimEvents(node)
        return events


class EventPynvml(FakePynvml):
    """:class:`FakePynvml` with pynvml's event-set calls (see the module docstring)."""

    def __init__(self, node: SimNode, **options: Any) -> None:
        super().__init__(node, **options)
        self.events = events_for(node)
        self.c_nvmlEventData_t = c_nvmlEventData_t
        self.nvmlEventTypeXidCriticalError = nvmlEventTypeXidCriticalError
        self.nvmlEventTypeDoubleBitEccError = nvmlEventTypeDoubleBitEccError
        self.nvmlEventMigConfigChange = nvmlEventMigConfigChange

    def _set_id(self, handle: Any) -> int:
        key = self._key(handle, ("event_set",))
        set_id: int = key[1]
        return set_id

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        return self._handle(c_nvmlEventSet_t, ("event_set", self.events.create()))

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any) -> int:
        self._device("nvmlDeviceGetSupportedEventTypes", handle)
        return SUPPORTED_EVENTS

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        gpu = self._device("nvmlDeviceRegisterEvents", handle)
        if eventTypes & ~SUPPORTED_EVENTS:
            raise api.NVMLError(api.NVML_ERROR_NOT_SUPPORTED)
        self.events.register(self._set_id(eventSet), gpu.index, eventTypes)

    def nvmlEventSetWait_v2(self, eventSet: Any, timeoutms: int) -> c_nvmlEventData_t:
        self._enter("nvmlEventSetWait_v2")
        pending = self.events.wait(self._set_id(eventSet), max(0, timeoutms) / 1000)
        data = c_nvmlEventData_t()
        data.device = self._handle(api.c_nvmlDevice_t, ("gpu", pending.gpu))
        data.eventType = pending.event_type
        data.eventData = pending.data
        data.gpuInstanceId = pending.gi_id
        data.computeInstanceId = pending.ci_id
        return data

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._enter("nvmlEventSetFree")
        self.events.free(self._set_id(eventSet))


class SimEventListener(NvmlEventListener):
    """The real listener over :class:`EventPynvml`; once it listens, it injects the XIDs
    ``health.sim_xids`` names (``GPU[/GI]:XID``), so a demo node starts with failures."""

    def __init__(
        self,
        node: SimNode,
        sim_xids: Sequence[str],
        gpus: Iterable[int],
        on_event: Callable[[GpuEvent], None],
        *,
        ignore_xids: Collection[int],
    ) -> None:
        super().__init__(EventPynvml(node), gpus, on_event, ignore_xids=ignore_xids)
        self.node = node
        self.sim_xids = tuple(sim_xids)

    def start(self) -> None:
        super().start()
        for item in self.sim_xids:
            where, _, xid = item.partition(":")
            gpu, _, gi = where.partition("/")
            events_for(self.node).inject_xid(int(gpu), int(xid), gi_id=int(gi) if gi else None)


class SimGpuEvents:
    """The :class:`migd.ports.GpuEvents` port on the simulated node."""

    def __init__(self, node: SimNode, sim_xids: Sequence[str] = ()) -> None:
        self.node = node
        self.sim_xids = tuple(sim_xids)

    def listener(
        self,
        gpus: Iterable[int],
        on_event: Callable[[GpuEvent], None],
        *,
        ignore_xids: Collection[int],
    ) -> SimEventListener:
        return SimEventListener(self.node, self.sim_xids, gpus, on_event, ignore_xids=ignore_xids)
