"""NvmlBackend against the simulated pynvml: discovery, geometry, instances, every error path."""

from __future__ import annotations

import ctypes.util
import logging
import threading
from dataclasses import replace

import pytest
from sim_support import Sim, SleepRecorder

from migd.backends.nvml import NvmlBackend, nvml_errors, translate_nvml_error
from migd.backends.simulated import FakePynvml, SimGpuSpec, SimNode
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.hardware import board
from migd.core import catalog
from migd.core.geometry import Geometry
from migd.errors import (
    DriverUnavailable,
    GpuBusy,
    GpuError,
    GpuNotFound,
    GpuPermissionDenied,
    GpuUnsupported,
    InstanceNotFound,
    InsufficientResources,
    InvalidStart,
    MigdError,
    MigModeError,
    UnknownProfile,
)
from migd.ports import GpuBackend

MODELS = list(catalog.builtin_models())


# -- discovery --------------------------------------------------------------------------------


def test_backend_satisfies_the_port(sim: Sim) -> None:
    backend, _ = sim("1xA100-40GB")
    assert isinstance(backend, GpuBackend)


def test_discovery_reports_what_nvml_says(sim: Sim) -> None:
    backend, node = sim("2xA100-40GB,1xH100-80GB,1xV100-32GB", cuda_version="12.4")
    infos = backend.discover()
    assert [i.index for i in infos] == [0, 1, 2, 3]
    for info, gpu in zip(infos, node.gpus, strict=True):
        facts = board(gpu.spec.model or "V100-32GB")
        assert (info.uuid, info.pci_bus_id) == (gpu.uuid, gpu.pci_bus_id)
        assert (info.name, info.pci_device_id) == (facts.name, facts.pci_device_id)
        assert info.memory_total_mib == facts.memory_total_mib
        assert info.compute_capability == facts.compute_capability
        assert (info.driver_version, info.cuda_version) == (node.driver_version, "12.4")
    assert [i.model for i in infos] == ["A100-40GB", "A100-40GB", "H100-80GB", None]
    assert [i.mig_current for i in infos] == [True, True, True, None]


def test_discovery_leaves_out_a_lost_gpu_and_keeps_indices(
    sim: Sim, caplog: pytest.LogCaptureFixture
) -> None:
    backend, node = sim("3xA100-40GB")
    node.lose_gpu(1)
    with caplog.at_level(logging.ERROR):
        infos = backend.discover()
    assert [i.index for i in infos] == [0, 2]
    assert "GPU 1 left out" in caplog.text


def test_detail_reads_degrade_to_unknown(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    node.fail_next("nvmlDeviceGetCudaComputeCapability", api.NVML_ERROR_NOT_SUPPORTED)
    node.fail_next("nvmlSystemGetCudaDriverVersion", api.NVML_ERROR_FUNCTION_NOT_FOUND)
    (info,) = backend.discover()
    assert info.compute_capability is None and info.cuda_version == ""
    assert info.model == "A100-40GB"


def test_missing_driver_is_driver_unavailable(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    node.fail_next("nvmlInitWithFlags", api.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(DriverUnavailable) as caught:
        backend.discover()
    assert "nvidia-smi" in caught.value.hint
    assert getattr(caught.value.__cause__, "value", None) == api.NVML_ERROR_LIBRARY_NOT_FOUND
    assert len(backend.discover()) == 1  # the next call initialises again


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="an NVIDIA driver is installed here"
)
def test_real_pynvml_without_a_driver_is_driver_unavailable() -> None:
    backend = NvmlBackend()  # imports the real pynvml
    with pytest.raises(DriverUnavailable, match="LIBRARY_NOT_FOUND"):
        backend.discover()
    backend.close()


def test_bindings_without_init_flags_fall_back_to_nvml_init(sim: Sim) -> None:
    _backend, node = sim("1xA100-40GB")
    fake = FakePynvml(node)

    class OldBindings:  # a pynvml from before nvmlInitWithFlags
        def __getattr__(self, name: str) -> object:
            if name == "nvmlInitWithFlags":
                raise AttributeError(name)
            return getattr(fake, name)

        def __dir__(self) -> list[str]:
            return [n for n in dir(fake) if n != "nvmlInitWithFlags"]

    assert len(NvmlBackend(OldBindings()).discover()) == 1
    assert (node.call_counts["nvmlInit"], node.call_counts["nvmlInitWithFlags"]) == (1, 0)


def test_gpus_are_driven_from_concurrent_threads(sim: Sim) -> None:
    # The daemon runs one worker thread per GPU over one backend.
    backend, node = sim("4xA100-40GB")
    failures: list[BaseException] = []

    def worker(gpu: int) -> None:
        try:
            for _ in range(30):
                made = [backend.create_instance(gpu, 19, start) for start in (6, 0, 3)]
                assert {m.start for m in backend.list_instances(gpu)} == {0, 3, 6}
                for m in made:
                    assert m.uuid is not None
                    backend.memory(gpu, m.uuid)
                    backend.destroy_instance(gpu, m.gi_id)
        except BaseException as exc:  # reported below, in the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(g,)) for g in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert all(node.placements(g) == frozenset() for g in range(4))


def test_close_ends_the_session_and_a_later_call_starts_another(sim: Sim) -> None:
    backend, _node = sim("1xA100-40GB")
    backend.discover()
    fake = backend.nvml
    assert isinstance(fake, FakePynvml)
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(api.NVMLError_Uninitialized):
        fake.nvmlDeviceGetCount()
    assert len(backend.discover()) == 1


# -- geometry ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_geometry_read_from_nvml_matches_the_builtin_table(sim: Sim, model: str) -> None:
    backend, _ = sim(f"1x{model}")
    geometry = backend.geometry(0)
    builtin = catalog.geometry(model)
    assert geometry.source == "nvml"
    assert geometry.units == builtin.units
    assert sorted(
        (
            p.profile_id,
            p.name,
            p.nvml_index,
            p.compute_slices,
            p.memory_slices,
            p.memory_mib,
            p.max_instances,
            p.starts,
            p.default_order,
            p.sm_count,
        )
        for p in geometry.profiles
    ) == sorted(
        (
            p.profile_id,
            p.name,
            p.nvml_index,
            p.compute_slices,
            p.memory_slices,
            p.memory_mib,
            p.max_instances,
            p.starts,
            p.default_order,
            p.sm_count,
        )
        for p in builtin.profiles
    )
    assert geometry.exclusive_groups == builtin.exclusive_groups
    assert backend.geometry(0) is geometry  # cached


def test_geometry_without_root_falls_back_to_the_builtin_table(sim: Sim) -> None:
    backend, _ = sim("1xH100-80GB", root=False)
    assert backend.geometry(0) is catalog.geometry("H100-80GB")


def test_geometry_with_mig_disabled_is_builtin_and_not_cached(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB:mig=off")
    assert backend.geometry(0) is catalog.geometry("A100-40GB")
    node.set_mig_mode(0, True)
    assert backend.geometry(0).source == "nvml"


def test_geometry_of_a_gpu_without_mig_is_unsupported(sim: Sim) -> None:
    backend, _ = sim("1xV100-32GB")
    with pytest.raises(GpuUnsupported, match="does not support MIG"):
        backend.geometry(0)


def _future_gpu() -> tuple[Geometry, SimGpuSpec]:
    """A MIG GPU migd has no table for (A30's geometry under another name), and its spec."""
    geo = catalog.geometry("A30-24GB")
    spec = SimGpuSpec(
        name="NVIDIA Future 24GB",
        pci_device_id=0x999910DE,
        memory_total_mib=24576,
        geometry=replace(geo, model="Future"),
    )
    return geo, spec


def test_unknown_model_needs_nvml_data(sim: Sim) -> None:
    # A MIG GPU migd has no table for: NVML alone must describe it.
    geo, spec = _future_gpu()
    backend, _ = sim(SimNode([spec]))
    assert backend.discover()[0].model is None
    geometry = backend.geometry(0)
    assert sorted((p.profile_id, p.starts) for p in geometry.profiles) == sorted(
        (p.profile_id, p.starts) for p in geo.profiles
    )
    unprivileged, node = sim(SimNode([spec], root=False))
    with pytest.raises(GpuPermissionDenied, match="needs root"):
        unprivileged.geometry(0)
    node.set_mig_mode(0, False)
    with pytest.raises(MigModeError, match="disabled"):
        NvmlBackend(FakePynvml(node)).geometry(0)


def test_one_profile_without_placements_falls_back_alone(
    sim: Sim, caplog: pytest.LogCaptureFixture
) -> None:
    backend, node = sim("1xA100-40GB")
    first = backend.profile_infos(0)[0]  # the enumeration's first profile (1g.5gb)
    node.fail_next("nvmlDeviceGetGpuInstancePossiblePlacements", api.NVML_ERROR_NOT_SUPPORTED)
    with caplog.at_level(logging.WARNING):
        geometry = backend.geometry(0)
    assert geometry.source == "nvml"  # the other profiles still came from NVML
    builtin = catalog.geometry("A100-40GB")
    assert geometry.by_id(first.profile_id).starts == builtin.by_id(first.profile_id).starts
    assert "no placements from NVML for profile" in caplog.text
    assert "built-in A100-40GB table" in caplog.text


def test_a_profile_without_placements_or_table_entry_is_left_out(sim: Sim) -> None:
    geo, spec = _future_gpu()
    backend, node = sim(SimNode([spec]))
    first = backend.profile_infos(0)[0]
    node.fail_next("nvmlDeviceGetGpuInstancePossiblePlacements", api.NVML_ERROR_NOT_SUPPORTED)
    geometry = backend.geometry(0)
    assert first.profile_id not in {p.profile_id for p in geometry.profiles}
    assert len(geometry.profiles) == len(geo.profiles) - 1


def test_engine_counts_are_nvmls_and_a_difference_is_logged(
    sim: Sim, caplog: pytest.LogCaptureFixture
) -> None:
    builtin = catalog.geometry("A100-40GB")
    media = builtin.profile("1g.5gb+me")
    assert media.engines is not None
    reported = {**media.engines, "dec": media.engines["dec"] + 1}  # a driver that differs
    profiles = tuple(replace(p, engines=reported) if p is media else p for p in builtin.profiles)
    spec = replace(
        SimGpuSpec.for_model("A100-40GB"),
        geometry=replace(builtin, profiles=profiles),
    )
    backend, _ = sim(SimNode([spec]))
    with caplog.at_level(logging.WARNING):
        geometry = backend.geometry(0)
    assert geometry.profile("1g.5gb+me").engines == reported
    assert geometry.profile("3g.20gb").engines == builtin.profile("3g.20gb").engines
    assert "engine counts differ" in caplog.text and "1g.5gb+me" in caplog.text


def test_unreadable_mig_mode_is_unknown_not_no_mig(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    node.fail_next("nvmlDeviceGetMigMode", api.NVML_ERROR_UNKNOWN, times=3)
    (info,) = backend.discover()
    assert (info.mig_current, info.mig_pending) == (None, None)
    assert not info.mig_mode_known
    assert info.mig_mode_error is not None and "NVML_ERROR_UNKNOWN" in info.mig_mode_error
    with pytest.raises(GpuError, match="MIG mode of GPU 0 cannot be read") as caught:
        backend.geometry(0)
    assert not isinstance(caught.value, GpuUnsupported)  # not "this GPU has no MIG"
    with pytest.raises(GpuError, match="cannot be read"):
        backend.list_instances(0)
    (info,) = backend.discover()  # readable again
    assert (info.mig_current, info.mig_mode_known) == (True, True)


# -- create / destroy every placement ---------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_every_placement_of_every_model_can_be_created_and_destroyed(sim: Sim, model: str) -> None:
    backend, node = sim(f"1x{model}")
    for profile in catalog.geometry(model).profiles:
        for start in profile.starts:
            made = backend.create_instance(0, profile.profile_id, start)
            assert (made.profile_id, made.start, made.size) == (
                profile.profile_id,
                start,
                profile.memory_slices,
            )
            assert made.memory_total_mib == profile.memory_mib
            assert made.uuid is not None and made.uuid.startswith("MIG-")
            assert node.placements(0) == {(profile.profile_id, start)}
            assert backend.list_instances(0) == [made]
            assert backend.memory(0, made.uuid).total_mib == profile.memory_mib
            backend.destroy_instance(0, made.gi_id)
            assert node.placements(0) == frozenset()


# -- illegal requests -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "existing", "request_", "error", "reason"),
    [
        ("A100-40GB", [(9, 0)], (5, 0), InsufficientResources, "overlaps 3g.20gb@0"),
        ("A100-40GB", [(0, 0)], (19, 6), InsufficientResources, "overlaps 7g.40gb@0"),
        ("A100-40GB", [], (9, 2), InvalidStart, "cannot start at unit 2"),
        ("A100-40GB", [], (14, 1), InvalidStart, "cannot start at unit 1"),
        ("A100-40GB", [(20, 0)], (20, 3), InsufficientResources, "at most 1"),
        ("A30-24GB", [(21, 0)], (6, 2), InsufficientResources, "only 1 instance"),
        ("RTX-PRO-6000-96GB", [(14, 0)], (65, 3), InsufficientResources, "engine"),
    ],
)
def test_illegal_requests_get_the_matching_migd_error(
    sim: Sim,
    model: str,
    existing: list[tuple[int, int]],
    request_: tuple[int, int],
    error: type[MigdError],
    reason: str,
) -> None:
    backend, node = sim(f"1x{model}")
    for profile_id, start in existing:
        backend.create_instance(0, profile_id, start)
    before = node.placements(0)
    with pytest.raises(error, match=reason) as caught:
        backend.create_instance(0, *request_)
    assert node.placements(0) == before
    assert caught.value.hint
    if error is InvalidStart:
        legal = catalog.geometry(model).by_id(request_[0]).starts
        assert caught.value.hint.endswith(", ".join(map(str, legal)))


def test_instance_limit_of_a_profile_is_enforced(sim: Sim) -> None:
    # No built-in model lets the per-profile limit bind before the slices run out, so
    # lower it: 1g.5gb may exist at most twice.
    geo = catalog.geometry("A100-40GB")
    limited = replace(
        geo,
        profiles=tuple(
            replace(p, max_instances=2) if p.profile_id == 19 else p for p in geo.profiles
        ),
    )
    spec = replace(SimGpuSpec.for_model("A100-40GB"), geometry=limited)
    backend, _ = sim(SimNode([spec]))
    backend.create_instance(0, 19, 0)
    backend.create_instance(0, 19, 1)
    with pytest.raises(InsufficientResources, match="at most 2"):
        backend.create_instance(0, 19, 2)


def test_unknown_profile_is_refused_before_nvml(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    with pytest.raises(UnknownProfile):
        backend.create_instance(0, 77, 0)
    assert node.call_counts["nvmlDeviceCreateGpuInstanceWithPlacement"] == 0


@pytest.mark.parametrize(
    ("flag", "fragment"), [("mig=off", "MIG is disabled"), ("mig=pending", "pending a GPU reset")]
)
def test_create_without_mig_enabled_is_a_mig_mode_error(sim: Sim, flag: str, fragment: str) -> None:
    backend, _ = sim(f"1xA100-40GB:{flag}")
    with pytest.raises(MigModeError, match=fragment):
        backend.create_instance(0, 9, 0)
    assert backend.list_instances(0) == []


def test_create_on_a_gpu_without_mig_is_unsupported(sim: Sim) -> None:
    backend, _ = sim("1xV100-32GB")
    with pytest.raises(GpuUnsupported):
        backend.create_instance(0, 9, 0)
    with pytest.raises(GpuUnsupported):
        backend.list_instances(0)


def test_without_root_mig_writes_and_listing_are_permission_denied(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    made = backend.create_instance(0, 9, 4)
    node.set_root(False)
    for action in (
        lambda: backend.create_instance(0, 9, 0),
        lambda: backend.destroy_instance(0, made.gi_id),
        lambda: backend.list_instances(0),
        lambda: backend.processes(0),
    ):
        with pytest.raises(GpuPermissionDenied) as caught:
            action()
        assert "root" in caught.value.hint
    assert node.placements(0) == {(9, 4)}


def test_lost_gpu_is_gpu_not_found_everywhere(sim: Sim) -> None:
    backend, node = sim("2xA100-40GB")
    made = backend.create_instance(1, 9, 4)
    node.lose_gpu(1)
    for action in (
        lambda: backend.create_instance(1, 9, 0),
        lambda: backend.destroy_instance(1, made.gi_id),
        lambda: backend.memory(1, made.uuid),
        lambda: backend.heartbeat(1),
    ):
        with pytest.raises(GpuNotFound, match="GPU_IS_LOST"):
            action()
    backend.heartbeat(0)
    with pytest.raises(GpuNotFound):
        backend.heartbeat(5)


# -- destroy ----------------------------------------------------------------------------------


def test_destroying_a_missing_instance_is_instance_not_found(sim: Sim) -> None:
    backend, _ = sim("1xA100-40GB")
    with pytest.raises(InstanceNotFound, match="no GPU instance 3") as caught:
        backend.destroy_instance(0, 3)
    assert "migctl status" in caught.value.hint


def test_in_use_is_retried_with_doubling_back_off(sim: Sim, sleeps: SleepRecorder) -> None:
    backend, node = sim("1xA100-40GB")
    made = backend.create_instance(0, 14, 0)
    node.fail_next("nvmlGpuInstanceDestroy", api.NVML_ERROR_IN_USE, times=2)
    backend.destroy_instance(0, made.gi_id)
    assert node.placements(0) == frozenset()
    assert sleeps.waits == [0.2, 0.4]


def test_in_use_beyond_the_retries_is_gpu_busy(sim: Sim, sleeps: SleepRecorder) -> None:
    backend, node = sim("1xA100-40GB", retry_backoff_s=0.5, destroy_retries=2)
    made = backend.create_instance(0, 14, 0)
    node.fail_next("nvmlComputeInstanceDestroy", api.NVML_ERROR_IN_USE, times=99)
    with pytest.raises(GpuBusy, match="still in use after 3 attempts") as caught:
        backend.destroy_instance(0, made.gi_id)
    assert sleeps.waits == [0.5, 1.0]
    assert isinstance(caught.value.__cause__, GpuBusy)
    assert node.placements(0) == {(14, 0)}


def test_partial_cleanup_is_finished_by_the_next_destroy(sim: Sim) -> None:
    # The CI goes, the GI destroy fails (seen in practice, reference §5.3): a retry must
    # not trip over the missing CI.
    backend, node = sim("1xA100-40GB", destroy_retries=0)
    made = backend.create_instance(0, 9, 0)
    node.fail_next("nvmlGpuInstanceDestroy", api.NVML_ERROR_IN_USE)
    with pytest.raises(GpuBusy):
        backend.destroy_instance(0, made.gi_id)
    assert [v.ci_ids for v in node.instances(0)] == [()]
    assert backend.list_instances(0)[0].ci_id is None
    backend.destroy_instance(0, made.gi_id)
    assert node.placements(0) == frozenset()


def _by_hand_3g_with_two_cis(node: SimNode) -> tuple[int, list[str]]:
    """An admin's 3g.20gb@4 split into two 1-slice compute instances: (GI id, MIG UUIDs)."""
    gi = node.mig.create_gpu_instance(0, 9, 4, 4)
    cis = [
        node.mig.create_compute_instance(gi.serial, api.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        for _ in range(2)
    ]
    return gi.gi_id, [ci.uuid for ci in cis]


def test_instances_made_by_hand_with_several_compute_instances_are_listed_whole(
    sim: Sim,
) -> None:
    backend, node = sim("1xA100-40GB")
    gi_id, uuids = _by_hand_3g_with_two_cis(node)
    (listed,) = backend.list_instances(0)
    assert [(c.ci_id, c.uuid, c.slices) for c in listed.compute_instances] == [
        (0, uuids[0], 1),
        (1, uuids[1], 1),
    ]
    assert (listed.gi_id, listed.ci_id, listed.uuid) == (gi_id, 0, uuids[0])  # the first
    for uuid in uuids:  # each MIG device can be queried
        assert backend.memory(0, uuid).total_mib == listed.memory_total_mib
    backend.destroy_instance(0, gi_id)
    assert node.placements(0) == frozenset()


def test_a_process_on_any_compute_instance_keeps_every_one_of_them(
    sim: Sim, sleeps: SleepRecorder
) -> None:
    # The process runs on the *second* compute instance: a destroy that went CI by CI
    # would remove the first, then stop, leaving the in-use instance half destroyed.
    backend, node = sim("1xA100-40GB", destroy_retries=1)
    gi_id, uuids = _by_hand_3g_with_two_cis(node)
    node.attach(4242, uuids[1])
    with pytest.raises(GpuBusy, match="processes 4242") as caught:
        backend.destroy_instance(0, gi_id)
    assert caught.value.details["pids"] == [4242]
    assert [v.uuids for v in node.instances(0)] == [tuple(uuids)]  # nothing destroyed
    assert node.call_counts["nvmlComputeInstanceDestroy"] == 0
    node.detach(4242)
    backend.destroy_instance(0, gi_id)
    assert node.placements(0) == frozenset()


def test_compute_instance_failure_rolls_the_gpu_instance_back(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    node.fail_next("nvmlGpuInstanceCreateComputeInstance", api.NVML_ERROR_INSUFFICIENT_RESOURCES)
    with pytest.raises(InsufficientResources):
        backend.create_instance(0, 9, 4)
    assert node.placements(0) == frozenset()
    assert backend.create_instance(0, 9, 4).start == 4


# -- error translation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (api.NVML_ERROR_NO_PERMISSION, GpuPermissionDenied),
        (api.NVML_ERROR_INSUFFICIENT_RESOURCES, InsufficientResources),
        (api.NVML_ERROR_IN_USE, GpuBusy),
        (api.NVML_ERROR_TIMEOUT, GpuBusy),
        (api.NVML_ERROR_RESET_REQUIRED, MigModeError),
        (api.NVML_ERROR_DRIVER_NOT_LOADED, DriverUnavailable),
        (api.NVML_ERROR_UNINITIALIZED, DriverUnavailable),
        (api.NVML_ERROR_LIB_RM_VERSION_MISMATCH, DriverUnavailable),
        (api.NVML_ERROR_FUNCTION_NOT_FOUND, GpuUnsupported),
        (api.NVML_ERROR_GPU_IS_LOST, GpuNotFound),
        (api.NVML_ERROR_NOT_SUPPORTED, GpuUnsupported),  # MIG is on: the call itself
        (api.NVML_ERROR_UNKNOWN, GpuError),
    ],
)
def test_injected_nvml_errors_surface_as_migd_errors(
    sim: Sim, code: int, error: type[MigdError]
) -> None:
    backend, node = sim("1xA100-40GB")
    backend.geometry(0)
    node.fail_next("nvmlDeviceCreateGpuInstanceWithPlacement", code)
    with pytest.raises(error) as caught:
        backend.create_instance(0, 9, 4)
    assert type(caught.value) is error  # the most specific class, not a parent
    assert caught.value.details["nvml_error"] == api.error_name(code)
    assert caught.value.details["gpu"] == 0
    assert getattr(caught.value.__cause__, "value", None) == code  # translated once, from exc
    assert node.placements(0) == frozenset()


@pytest.mark.parametrize(
    ("mode", "error", "fragment"),
    [
        ((None, None), GpuUnsupported, "has no MIG"),
        ((False, False), MigModeError, "MIG is disabled"),
        ((False, True), MigModeError, "pending a GPU reset"),
        ((True, True), GpuUnsupported, "not supported by this GPU"),
    ],
)
def test_not_supported_is_explained_by_the_mig_mode(
    mode: tuple[bool | None, bool | None], error: type[MigdError], fragment: str
) -> None:
    err = translate_nvml_error(api.NVML_ERROR_NOT_SUPPORTED, op="x", gpu=2, mig_mode=lambda: mode)
    assert type(err) is error and fragment in err.message and err.details["gpu"] == 2


def test_nvml_errors_passes_other_exceptions_through() -> None:
    with pytest.raises(KeyError), nvml_errors("x"):
        raise KeyError("not NVML")
    with pytest.raises(GpuBusy), nvml_errors("x"):
        raise GpuBusy("already translated")
    with pytest.raises(InstanceNotFound), nvml_errors("x", not_found=InstanceNotFound):
        raise api.NVMLError(api.NVML_ERROR_NOT_FOUND)


# -- MIG device UUIDs ---------------------------------------------------------------------------


def test_the_compute_instance_info_names_the_parent_gpu_as_nvml_h_documents(sim: Sim) -> None:
    # nvml.h: nvmlComputeInstanceInfo_t.device is "Parent device". Its UUID is the GPU's,
    # so the MIG UUID must come from the MIG device handles instead.
    backend, node = sim("1xA100-40GB")
    made = backend.create_instance(0, 9, 4)
    nvml = backend.nvml
    gpu = nvml.nvmlDeviceGetHandleByIndex(0)
    gi = nvml.nvmlDeviceGetGpuInstanceById(gpu, made.gi_id)
    assert made.ci_id is not None
    ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, made.ci_id)
    parent_uuid = nvml.nvmlDeviceGetUUID(gpu)
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlComputeInstanceGetInfo(ci).device) == parent_uuid
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlGpuInstanceGetInfo(gi).device) == parent_uuid
    (view,) = node.instances(0)
    assert made.uuid == view.uuids[0] != parent_uuid
    assert made.uuid is not None and made.uuid.startswith("MIG-")
    assert backend.list_instances(0) == [made]


@pytest.mark.parametrize("ci_info_device", ["parent", "mig"])
def test_mig_uuids_are_right_whatever_the_driver_puts_in_the_ci_info(
    ci_info_device: str,
) -> None:
    node = SimNode.from_description("1xA100-40GB")
    backend = NvmlBackend(FakePynvml(node, ci_info_device=ci_info_device))  # type: ignore[arg-type]
    made = [backend.create_instance(0, 14, start) for start in (0, 2, 4)]
    backend.destroy_instance(0, made[1].gi_id)  # leaves an empty MIG device slot
    made[1] = backend.create_instance(0, 19, 2)
    truth = {v.gi_id: v.uuids for v in node.instances(0)}
    assert {m.gi_id: (m.uuid,) for m in made} == truth
    assert {m.gi_id: (m.uuid,) for m in backend.list_instances(0)} == truth
    walked = node.call_counts["nvmlDeviceGetMigDeviceHandleByIndex"]
    if ci_info_device == "mig":  # NVML confirmed the handle: no walk on create
        node.call_counts.clear()
        backend.create_instance(0, 19, 3)
        assert node.call_counts["nvmlDeviceGetMigDeviceHandleByIndex"] == 0
    else:
        assert walked > 0


def test_a_mig_device_handle_that_names_another_device_is_not_trusted(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    made = backend.create_instance(0, 9, 0)
    assert made.uuid is not None
    # The cached handle goes stale (the instance is re-created behind our back): the
    # backend looks again rather than reading the wrong device.
    other = NvmlBackend(FakePynvml(node))
    other.destroy_instance(0, made.gi_id)
    again = other.create_instance(0, 9, 0)
    node.attach(5, again.uuid or "")
    assert [p.pid for p in backend.processes(0, again.uuid)] == [5]
    with pytest.raises(GpuNotFound):
        backend.processes(0, made.uuid)


# -- memory, processes, heartbeat -------------------------------------------------------------


def test_unknown_mig_uuid_is_gpu_not_found(sim: Sim) -> None:
    backend, _ = sim("1xA100-40GB")
    backend.create_instance(0, 9, 4)
    with pytest.raises(GpuNotFound, match="no MIG device MIG-nope") as caught:
        backend.memory(0, "MIG-nope")
    assert "re-created" in caught.value.hint


def test_mig_uuid_of_a_recreated_instance_is_found_again(sim: Sim) -> None:
    backend, node = sim("1xA100-40GB")
    old = backend.create_instance(0, 9, 4)
    backend.memory(0, old.uuid)
    # Another client re-creates it behind the backend's back: same ids, new UUID.
    other = NvmlBackend(FakePynvml(node))
    other.destroy_instance(0, old.gi_id)
    new = other.create_instance(0, 9, 4)
    assert (new.gi_id, new.ci_id) == (old.gi_id, old.ci_id) and new.uuid != old.uuid
    assert backend.memory(0, new.uuid).total_mib == new.memory_total_mib
    with pytest.raises(GpuNotFound):
        backend.memory(0, old.uuid)


def test_mps_listing_unsupported_still_lists_compute_processes(sim: Sim) -> None:
    backend, node = sim("1xV100-32GB")
    node.attach(7, node.gpu(0).uuid)
    node.alloc(7, 100)
    node.fail_next("nvmlDeviceGetMPSComputeRunningProcesses", api.NVML_ERROR_NOT_SUPPORTED)
    assert [(p.pid, p.used_mib, p.mig_uuid) for p in backend.processes(0)] == [(7, 100, None)]
