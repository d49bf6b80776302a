"""The simulated pynvml keeps pynvml's contract: names, codes, layouts, signatures, pointers.

Each check compares with the installed ``pynvml`` (nvidia-ml-py), so a drift on
either side fails here rather than hiding behind the simulator.
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import re
from pathlib import Path

import pynvml
import pytest

import migd.backends.nvml as nvml_backend_module
from migd.backends.simulated import FakePynvml, SimNode
from migd.backends.simulated import nvml_api as api
from migd.backends.simulated.fake_pynvml import FAKE_FUNCTIONS, PRIVILEGED_CALLS, WRITE_CALLS


@pytest.fixture
def fake() -> FakePynvml:
    nvml = FakePynvml(SimNode.from_description("1xA100-40GB"))
    nvml.nvmlInit()
    return nvml


def test_every_constant_has_pynvmls_value() -> None:
    names = [
        n for n in dir(api) if n.startswith(("NVML_", "nvml")) and isinstance(getattr(api, n), int)
    ]
    assert len(names) > 60
    for name in names:
        assert getattr(api, name) == getattr(pynvml, name), name


def test_every_name_the_stand_in_exposes_exists_in_pynvml(fake: FakePynvml) -> None:
    exposed = [n for n in dir(fake) if n.startswith(("nvml", "NVML", "c_nvml", "struct_c_nvml"))]
    assert len(exposed) > 100
    assert [n for n in exposed if not hasattr(pynvml, n)] == []


def test_error_classes_have_pynvmls_names_and_codes() -> None:
    assert set(api.ERROR_CLASSES) == {n for n in dir(pynvml) if n.startswith("NVMLError_")}
    for name, cls in api.ERROR_CLASSES.items():
        real = getattr(pynvml, name)
        assert cls().value == real().value, name
        assert type(api.NVMLError(real().value)) is cls  # NVMLError(code) picks the subclass
        assert isinstance(cls(), api.NVMLError)


def _layout(struct: type[ctypes.Structure]) -> list[tuple[str, int]]:
    return [(name, ctypes.sizeof(ctype)) for name, ctype, *_ in struct._fields_]


def test_structures_have_pynvmls_layout() -> None:
    structures = [
        n
        for n in dir(api)
        if isinstance(getattr(api, n), type)
        and issubclass(getattr(api, n), ctypes.Structure)
        and getattr(getattr(api, n), "_fields_", None)
        and hasattr(pynvml, n)
    ]
    assert {
        "c_nvmlGpuInstancePlacement_t",
        "c_nvmlGpuInstanceInfo_t",
        "nvmlPciInfo_t",
        "c_nvmlComputeInstanceInfo_t",
        "c_nvmlGpuInstanceProfileInfo_v2_t",
    } <= set(structures)
    for name in structures:
        ours, theirs = getattr(api, name), getattr(pynvml, name)
        assert _layout(ours) == _layout(theirs), name
        assert ctypes.sizeof(ours) == ctypes.sizeof(theirs), name
    for handle in ("c_nvmlDevice_t", "c_nvmlGpuInstance_t", "c_nvmlComputeInstance_t"):
        assert issubclass(getattr(api, handle), ctypes._Pointer)
        assert ctypes.sizeof(getattr(api, handle)) == ctypes.sizeof(getattr(pynvml, handle))


def test_functions_have_pynvmls_signatures(fake: FakePynvml) -> None:
    assert len(FAKE_FUNCTIONS) >= 25
    for name in FAKE_FUNCTIONS:
        theirs = inspect.signature(getattr(pynvml, name)).parameters
        ours = inspect.signature(getattr(fake, name)).parameters
        assert [(p.name, p.default) for p in ours.values()] == [
            (p.name, p.default) for p in theirs.values()
        ], name
    assert set(FAKE_FUNCTIONS) >= PRIVILEGED_CALLS
    assert set(FAKE_FUNCTIONS) >= WRITE_CALLS


def _names_backend_uses() -> set[str]:
    """Every ``nvml.<name>`` the backend module reads (functions, constants, types), plus
    function names it looks up with ``getattr`` (string literals ``"nvml..."``, and the
    ``_v2`` variants it falls back to)."""
    tree = ast.parse(Path(nvml_backend_module.__file__).read_text())
    names = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "nvml"
    }
    looked_up = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"nvml[A-Z]\w*", node.value)
    }
    return names | looked_up | {f"{name}_v2" for name in looked_up if "Processes" in name}


def test_the_stand_in_covers_every_pynvml_name_the_backend_uses(fake: FakePynvml) -> None:
    used = _names_backend_uses()
    assert {
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceDestroy",
        "c_nvmlGpuInstancePlacement_t",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    } <= used  # the scan sees the calls
    for name in used:
        assert hasattr(pynvml, name), f"pynvml has no {name}"
        assert hasattr(fake, name), f"the simulated pynvml lacks {name}"


def test_placement_passed_by_value_is_refused_before_touching_the_gpu(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    placement = fake.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = 4, 4
    with pytest.raises(TypeError, match="byref"):
        fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, placement)
    assert fake.node.placements(0) == frozenset()
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, ctypes.byref(placement))
    assert fake.node.placements(0) == {(9, 4)}
    placement.start = 0
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, ctypes.pointer(placement))
    assert fake.node.placements(0) == {(9, 4), (9, 0)}


def test_the_backend_passes_the_placement_by_reference(fake: FakePynvml) -> None:
    from migd.backends.nvml import NvmlBackend

    seen: list[object] = []
    create = fake.nvmlDeviceCreateGpuInstanceWithPlacement

    def spy(device: object, profile_id: int, placement: object) -> object:
        seen.append(placement)
        return create(device, profile_id, placement)

    fake.nvmlDeviceCreateGpuInstanceWithPlacement = spy  # type: ignore[method-assign]
    NvmlBackend(fake).create_instance(0, 14, 2)
    assert len(seen) == 1
    assert type(seen[0]) is type(ctypes.byref(ctypes.c_uint()))


def test_count_passed_by_value_and_short_arrays_are_refused(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    with pytest.raises(TypeError, match="by reference"):
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(device, 19, None, count)
    fake.nvmlDeviceGetGpuInstancePossiblePlacements(device, 19, None, ctypes.byref(count))
    assert count.value == 7  # NULL array: NVML only reports the count
    short = (fake.c_nvmlGpuInstancePlacement_t * 6)()
    with pytest.raises(ValueError, match="past its end"):
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(device, 19, short, ctypes.byref(count))
    exact = (fake.c_nvmlGpuInstancePlacement_t * 7)()
    fake.nvmlDeviceGetGpuInstancePossiblePlacements(device, 19, exact, ctypes.byref(count))
    assert [(p.start, p.size) for p in exact] == [(s, 1) for s in range(7)]


def test_calls_outside_an_nvml_session_fail_uninitialized() -> None:
    nvml = FakePynvml(SimNode.from_description("1xA100-40GB"))
    with pytest.raises(api.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInitWithFlags(api.NVML_INIT_FLAG_NO_GPUS)
    assert nvml.nvmlDeviceGetCount() == 1
    nvml.nvmlShutdown()
    with pytest.raises(api.NVMLError) as caught:
        nvml.nvmlDeviceGetHandleByIndex(0)
    assert caught.value.value == pynvml.NVML_ERROR_UNINITIALIZED


def test_handles_are_pynvml_pointer_types_and_go_stale(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    assert isinstance(device, fake.c_nvmlDevice_t)
    placement = fake.c_nvmlGpuInstancePlacement_t(0, 8)
    gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 0, ctypes.byref(placement))
    assert isinstance(gi, fake.c_nvmlGpuInstance_t)
    assert fake.nvmlGpuInstanceGetInfo(gi).id == 0  # the whole-GPU instance is id 0
    fake.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(api.NVMLError_InvalidArgument):
        fake.nvmlGpuInstanceGetInfo(gi)
    with pytest.raises(api.NVMLError_InvalidArgument):  # a GI handle is not a device handle
        fake.nvmlDeviceGetUUID(
            fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 0, ctypes.byref(placement))
        )


def test_unknown_profile_indices_follow_nvmls_enumeration_contract(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetGpuInstanceProfileInfo(device, 0).id == 19
    with pytest.raises(api.NVMLError_NotSupported):  # 6-slice profile: not on A100
        fake.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
    with pytest.raises(api.NVMLError_InvalidArgument):  # past the enum: end of enumeration
        fake.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)


def test_string_fields_read_back_as_str_like_pynvml(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    info = fake.nvmlDeviceGetGpuInstanceProfileInfo(device, 0)
    assert info.name == "MIG 1g.5gb"
    assert isinstance(fake.nvmlDeviceGetPciInfo(device).busId, str)
