"""NVML events: what each event means for migd (classify), and the listener on the
simulated node's event sets (XID injection, attribution to MIG instances)."""

from __future__ import annotations

import queue

import pytest

from migd.backends.nvml.events import (
    APPLICATION_XIDS,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_MIG_CONFIG_CHANGE,
    EVENT_PSTATE,
    EVENT_XID_CRITICAL,
    NOT_ATTRIBUTED,
    GpuEvent,
    NvmlEventListener,
    classify,
)
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated import simulated_backend
from migd.backends.simulated.node import SimNode
from migd.backends.simulated.nvml_events import EventPynvml, events_for


@pytest.mark.parametrize("xid", APPLICATION_XIDS)
def test_application_fault_xids_never_take_a_gpu_out(xid: int) -> None:
    event = classify(0, EVENT_XID_CRITICAL, xid)
    assert event is not None and not event.critical and not event.instance_lost
    assert "application fault" in event.reason


def test_gpu_wide_xids_lose_every_instance_even_when_attributed() -> None:
    event = classify(1, EVENT_XID_CRITICAL, 79, 3, 0)
    assert event == GpuEvent(
        1,
        "xid",
        79,
        None,
        None,
        True,
        True,
        "XID 79 (GPU has fallen off the bus) on GPU 1 GPU instance 3",
    )


def test_an_attributed_xid_loses_that_instance_and_an_unattributed_one_none() -> None:
    on_gi = classify(0, EVENT_XID_CRITICAL, 94, 5, 0)
    assert on_gi is not None and on_gi.critical and on_gi.instance_lost
    assert (on_gi.gi_id, on_gi.ci_id) == (5, 0)
    whole = classify(0, EVENT_XID_CRITICAL, 74, NOT_ATTRIBUTED, NOT_ATTRIBUTED)
    assert whole is not None and whole.critical and not whole.instance_lost
    assert whole.gi_id is None


def test_ecc_mig_changes_and_other_events() -> None:
    dbe = classify(2, EVENT_DOUBLE_BIT_ECC, 0)
    assert dbe is not None and dbe.critical and dbe.instance_lost and dbe.kind == "ecc_dbe"
    mig = classify(2, EVENT_MIG_CONFIG_CHANGE, 0)
    assert mig is not None and not mig.critical and mig.kind == "mig_config"
    assert classify(2, EVENT_PSTATE, 0) is None


def test_the_ignore_list_is_configurable() -> None:
    event = classify(0, EVENT_XID_CRITICAL, 13, ignore_xids=())
    assert event is not None and event.critical


def listen(node: SimNode, gpus: list[int]) -> tuple[NvmlEventListener, queue.Queue[GpuEvent]]:
    got: queue.Queue[GpuEvent] = queue.Queue()
    listener = NvmlEventListener(EventPynvml(node), gpus, got.put, wait_ms=50)
    listener.start()
    return listener, got


def test_the_listener_reports_injected_xids_with_their_instance() -> None:
    backend, node = simulated_backend("2xA100-40GB")
    backend.discover()
    inst = backend.create_instance(1, 19, 0)  # 1g.5gb at start 0
    listener, got = listen(node, [0, 1])
    try:
        wanted = EVENT_XID_CRITICAL | EVENT_DOUBLE_BIT_ECC
        assert listener.registered == {0: wanted, 1: wanted}
        events_for(node).inject_xid(0, 13)
        app = got.get(timeout=30)
        assert (app.gpu, app.xid, app.critical) == (0, 13, False)
        events_for(node).inject_xid(1, 94, gi_id=inst.gi_id, ci_id=0)
        on_gi = got.get(timeout=30)
        assert (on_gi.gpu, on_gi.gi_id, on_gi.critical, on_gi.instance_lost) == (
            1,
            inst.gi_id,
            True,
            True,
        )
        events_for(node).inject_ecc_dbe(0)
        assert got.get(timeout=30).kind == "ecc_dbe"
    finally:
        listener.stop()
    assert got.empty()


def test_xid_79_loses_the_gpu_as_hardware_does() -> None:
    backend, node = simulated_backend("2xA100-40GB")
    backend.discover()
    listener, got = listen(node, [0, 1])
    try:
        events_for(node).inject_xid(0, 79)
        event = got.get(timeout=30)
        assert event.critical and event.instance_lost and event.gi_id is None
    finally:
        listener.stop()
    nvml = EventPynvml(node)
    nvml.nvmlInit()
    with pytest.raises(api.NVMLError) as lost:
        nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
    assert lost.value.value == api.NVML_ERROR_GPU_IS_LOST
    nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(1))  # the other one works


def test_a_lost_gpu_cannot_register_and_the_others_still_listen() -> None:
    _, node = simulated_backend("2xA100-40GB")
    node.lose_gpu(0)
    listener, got = listen(node, [0, 1])
    try:
        assert list(listener.registered) == [1]
        assert "cannot register" in listener.unsupported[0]
        assert events_for(node).inject_xid(1, 48) == 1
        assert got.get(timeout=30).xid == 48
    finally:
        listener.stop()


def test_event_sets_follow_nvml_h() -> None:
    _, node = simulated_backend("1xA100-40GB")
    nvml = EventPynvml(node)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    es = nvml.nvmlEventSetCreate()
    # Nothing registered yet: an injected event goes nowhere, a wait times out.
    assert events_for(node).inject_xid(0, 31) == 0
    with pytest.raises(api.NVMLError) as timeout:
        nvml.nvmlEventSetWait_v2(es, 0)
    assert timeout.value.value == api.NVML_ERROR_TIMEOUT
    with pytest.raises(api.NVMLError) as unsupported:
        nvml.nvmlDeviceRegisterEvents(handle, 0x80, es)  # power source: no battery here
    assert unsupported.value.value == api.NVML_ERROR_NOT_SUPPORTED
    nvml.nvmlDeviceRegisterEvents(handle, EVENT_XID_CRITICAL, es)
    events_for(node).inject_xid(0, 31)  # queued while nobody waits
    data = nvml.nvmlEventSetWait_v2(es, 0)
    assert (data.eventType, data.eventData, data.gpuInstanceId) == (
        EVENT_XID_CRITICAL,
        31,
        NOT_ATTRIBUTED,
    )
    with pytest.raises(ValueError, match="no GPU instance 9"):
        events_for(node).inject_xid(0, 31, gi_id=9)
    nvml.nvmlEventSetFree(es)
    with pytest.raises(api.NVMLError):
        nvml.nvmlEventSetWait_v2(es, 0)
