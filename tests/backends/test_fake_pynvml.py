"""The simulated pynvml keeps pynvml's contract: names, codes, layouts, signatures, pointers.

Each check compares with the installed ``pynvml`` (nvidia-ml-py), so a drift on
either side fails here rather than hiding behind the simulator.
"""

from __future__ import annotations

import ast
import ctypes
import inspect
import re
from collections.abc import Callable
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
    """Every ``nvml.<name>`` the backend package reads (functions, constants, types), plus
    function names it looks up with ``getattr`` (string literals ``"nvml..."``, and the
    ``_v2`` variants it falls back to), over all of the package's modules."""
    package = Path(nvml_backend_module.__file__).parent
    # events.py (the GpuEvents port over real NVML) is left out: the simulated node serves
    # that port itself (backends/simulated/nvml_events.py: SimGpuEvents), never through
    # the stand-in pynvml, so the stand-in need not have NVML's event calls.
    nodes = [
        node
        for module in sorted(package.glob("*.py"))
        if module.name != "events.py"
        for node in ast.walk(ast.parse(module.read_text()))
    ]
    names = {
        node.attr
        for node in nodes
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "nvml"
    }
    looked_up = {
        node.value
        for node in nodes
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


# -- return values, MIG device handles, argument checks --------------------------------------


def _pynvml_functions() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(pynvml))
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _returns(name: str, functions: dict[str, ast.FunctionDef]) -> set[str]:
    """What a pynvml function returns, from its source: ``success`` (NVML_SUCCESS),
    ``scalar`` (a ``.value``), ``list``, ``tuple``, ``None``, or the ctypes type names a
    returned variable was built from."""
    function = functions[name]
    built: dict[str, set[str]] = {}
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            value = node.value
            kind = (
                value.func.id
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                else "list"
                if isinstance(value, ast.List | ast.ListComp)
                else "other"
            )
            built.setdefault(node.targets[0].id, set()).add(kind)
    kinds: set[str] = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Return):
            continue
        value = node.value
        if value is None or (isinstance(value, ast.Constant) and value.value is None):
            kinds.add("None")
        elif isinstance(value, ast.Name) and value.id == "NVML_SUCCESS":
            kinds.add("success")
        elif isinstance(value, ast.Attribute) and value.attr == "value":
            kinds.add("scalar")
        elif isinstance(value, ast.Tuple):
            kinds.add("tuple")
        elif isinstance(value, ast.List | ast.ListComp):
            kinds.add("list")
        elif isinstance(value, ast.Name) and value.id in built:
            kinds |= built[value.id]
        elif (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id in functions
        ):
            kinds |= _returns(value.func.id, functions)  # a wrapper of a versioned call
        else:
            kinds.add(ast.unparse(value))
    return kinds


def _matches(result: object, kinds: set[str]) -> bool:
    checks = {
        "None": lambda r: r is None,
        "success": lambda r: r == pynvml.NVML_SUCCESS and type(r) is int,
        "scalar": lambda r: isinstance(r, int | str | bytes | float),
        "list": lambda r: isinstance(r, list),
        "tuple": lambda r: isinstance(r, tuple),
    }
    for kind in kinds:
        check = checks.get(kind)
        if check is not None and check(result):
            return True
        real = getattr(pynvml, kind, None) or getattr(ctypes, kind, None)
        if isinstance(real, type) and type(result).__name__ == real.__name__:
            return True
    return False


def _a_node_with_instances() -> tuple[FakePynvml, dict[str, object]]:
    nvml = FakePynvml(SimNode.from_description("1xA100-40GB"))
    nvml.nvmlInit()
    device = nvml.nvmlDeviceGetHandleByIndex(0)
    placement = nvml.c_nvmlGpuInstancePlacement_t(4, 4)
    gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, ctypes.byref(placement))
    ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0)
    nvml.node.attach(77, nvml.nvmlDeviceGetUUID(mig))
    count = ctypes.c_uint(0)
    return nvml, {"device": device, "gi": gi, "ci": ci, "mig": mig, "count": count}


def _call_args(name: str, nvml: FakePynvml, h: dict[str, object]) -> tuple[object, ...]:
    """Valid arguments for one call on the node of :func:`_a_node_with_instances`."""
    device, gi, ci, mig, count = h["device"], h["gi"], h["ci"], h["mig"], h["count"]
    ref = ctypes.byref(count)  # type: ignore[arg-type]

    def new_gi(profile_id: int, start: int, size: int) -> object:
        placement = nvml.c_nvmlGpuInstancePlacement_t(start, size)
        return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            device, profile_id, ctypes.byref(placement)
        )

    table: dict[str, Callable[[], tuple[object, ...]]] = {
        "nvmlInitWithFlags": lambda: (0,),
        "nvmlDeviceGetHandleByIndex": lambda: (0,),
        "nvmlDeviceGetGpuInstanceProfileInfo": lambda: (device, 2),
        "nvmlDeviceGetGpuInstancePossiblePlacements": lambda: (device, 9, None, ref),
        "nvmlDeviceCreateGpuInstanceWithPlacement": lambda: (
            device,
            14,
            ctypes.byref(nvml.c_nvmlGpuInstancePlacement_t(0, 2)),
        ),
        "nvmlDeviceGetGpuInstances": lambda: (device, 9, (nvml.c_nvmlGpuInstance_t * 2)(), ref),
        "nvmlDeviceGetGpuInstanceById": lambda: (device, 2),  # 3g.20gb at 4: id 2
        "nvmlGpuInstanceGetComputeInstanceProfileInfo": lambda: (gi, 2, 0),
        "nvmlGpuInstanceCreateComputeInstance": lambda: (new_gi(19, 0, 1), 0),
        "nvmlGpuInstanceGetComputeInstances": lambda: (
            gi,
            2,
            (nvml.c_nvmlComputeInstance_t * 1)(),
            ref,
        ),
        "nvmlGpuInstanceGetComputeInstanceById": lambda: (gi, 0),
        "nvmlGpuInstanceDestroy": lambda: (new_gi(19, 1, 1),),
        "nvmlComputeInstanceDestroy": lambda: (ci,),
        "nvmlDeviceGetMigDeviceHandleByIndex": lambda: (device, 0),
        "nvmlDeviceGetGpuInstanceRemainingCapacity": lambda: (device, 19),
        "nvmlDeviceGetGpuInstanceProfileInfoById": lambda: (device, 19),
        "nvmlDeviceGetGpuInstanceId": lambda: (mig,),
        "nvmlDeviceGetComputeInstanceId": lambda: (mig,),
        "nvmlDeviceGetDeviceHandleFromMigDeviceHandle": lambda: (mig,),
        "nvmlComputeInstanceGetInfo": lambda: (ci,),
        "nvmlGpuInstanceGetInfo": lambda: (gi,),
    }
    if name in table:
        return table[name]()
    params = inspect.signature(getattr(pynvml, name)).parameters
    return tuple(device for p in params.values() if p.default is inspect.Parameter.empty)


def test_functions_return_what_pynvml_returns() -> None:
    functions = _pynvml_functions()
    checked = 0
    for name in FAKE_FUNCTIONS:
        nvml, handles = _a_node_with_instances()
        if name == "nvmlComputeInstanceDestroy":
            nvml.node.detach(77)
        kinds = _returns(name, functions)
        result = getattr(nvml, name)(*_call_args(name, nvml, handles))
        assert _matches(result, kinds), f"{name} returned {result!r}; pynvml returns {kinds}"
        checked += 1
    assert checked == len(FAKE_FUNCTIONS) >= 35


def test_mig_device_handles_by_index_with_holes_like_nvml(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    made = []
    for start in (0, 2, 4):
        placement = fake.c_nvmlGpuInstancePlacement_t(start, 2)
        gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 14, ctypes.byref(placement))
        made.append((gi, fake.nvmlGpuInstanceCreateComputeInstance(gi, 1)))
    fake.nvmlComputeInstanceDestroy(made[1][1])
    fake.nvmlGpuInstanceDestroy(made[1][0])
    assert fake.nvmlDeviceGetMaxMigDeviceCount(device) == 7
    found = {}
    for index in range(7):
        try:
            mig = fake.nvmlDeviceGetMigDeviceHandleByIndex(device, index)
        except api.NVMLError_NotFound:  # an empty slot
            continue
        assert fake.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        parent = fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
        assert fake.nvmlDeviceGetUUID(parent) == fake.nvmlDeviceGetUUID(device)
        ids = (fake.nvmlDeviceGetGpuInstanceId(mig), fake.nvmlDeviceGetComputeInstanceId(mig))
        found[index] = (ids, fake.nvmlDeviceGetUUID(mig))
    views = fake.node.instances(0)
    assert sorted(found.values()) == sorted(((v.gi_id, 0), v.uuids[0]) for v in views)
    assert sorted(found) == [0, 2]  # the destroyed one left a hole at index 1
    with pytest.raises(api.NVMLError_InvalidArgument):  # past the end
        fake.nvmlDeviceGetMigDeviceHandleByIndex(device, 7)
    assert fake.nvmlDeviceIsMigDeviceHandle(device).value == 0
    with pytest.raises(api.NVMLError_NotSupported):  # a parent has no GI id
        fake.nvmlDeviceGetGpuInstanceId(device)
    with pytest.raises(api.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)


def test_remaining_capacity_and_profile_info_by_id(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 7
    placement = fake.c_nvmlGpuInstancePlacement_t(4, 4)
    fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, ctypes.byref(placement))
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 19) == 4  # units 0-3
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 9) == 1
    assert fake.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 0) == 0  # 7g: no room
    assert fake.node.placements(0) == {(9, 4)}  # asking changed nothing
    by_id = fake.nvmlDeviceGetGpuInstanceProfileInfoById(device, 9)
    by_index = fake.nvmlDeviceGetGpuInstanceProfileInfo(device, 2)
    assert _layout_values(by_id) == _layout_values(by_index)
    with pytest.raises(api.NVMLError_NotSupported):
        fake.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 1234)


def _layout_values(struct: ctypes.Structure) -> list[object]:
    return [getattr(struct, name) for name, *_ in struct._fields_]


def test_null_arrays_are_invalid_where_nvml_h_does_not_allow_them(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    placement = fake.c_nvmlGpuInstancePlacement_t(4, 4)
    gi = fake.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, ctypes.byref(placement))
    fake.nvmlGpuInstanceCreateComputeInstance(gi, 2)
    count = ctypes.c_uint(99)
    with pytest.raises(api.NVMLError_InvalidArgument):
        fake.nvmlDeviceGetGpuInstances(device, 9, None, ctypes.byref(count))
    with pytest.raises(api.NVMLError_InvalidArgument):
        fake.nvmlGpuInstanceGetComputeInstances(gi, 2, None, ctypes.byref(count))
    assert count.value == 99  # nothing written
    fake.nvmlDeviceGetGpuInstancePossiblePlacements(device, 9, None, ctypes.byref(count))
    assert count.value == 2  # documented: NULL asks for the count


@pytest.fixture
def libc_abs(monkeypatch: pytest.MonkeyPatch) -> None:
    """pynvml calling a real C function without ``argtypes``, as it calls NVML's.

    Only arguments ctypes refuses to convert are passed, so nothing is ever called.
    """
    function = ctypes.CDLL(None).abs
    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", lambda name: function)


@pytest.mark.usefixtures("libc_abs")
def test_arguments_ctypes_refuses_are_refused_the_same_way(fake: FakePynvml) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    array = (fake.c_nvmlGpuInstance_t * 2)()
    bad_calls = [
        ("nvmlDeviceGetGpuInstances", (device, 9, [None, None], ctypes.byref(count))),
        ("nvmlDeviceGetGpuInstances", (device, 9.0, array, ctypes.byref(count))),
        ("nvmlDeviceGetGpuInstanceById", (device, 1.0)),
        (
            "nvmlDeviceGetGpuInstancePossiblePlacements",
            (device, 9, [0] * 7, ctypes.byref(count)),
        ),
        ("nvmlDeviceGetGpuInstanceProfileInfo", (device, 2.0)),
    ]
    for name, args in bad_calls:
        with pytest.raises(ctypes.ArgumentError) as real:
            getattr(pynvml, name)(*args)
        with pytest.raises(ctypes.ArgumentError) as ours:
            getattr(fake, name)(*args)
        assert str(ours.value) == str(real.value), name
    assert fake.node.call_counts["nvmlDeviceGetGpuInstances"] == 0  # refused before NVML
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 0.0)
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        fake.nvmlDeviceGetMigDeviceHandleByIndex(device, 0.0)


def test_an_array_of_the_wrong_type_would_corrupt_memory_and_is_refused(
    fake: FakePynvml,
) -> None:
    device = fake.nvmlDeviceGetHandleByIndex(0)
    count = ctypes.c_uint(0)
    wrong = (ctypes.c_uint * 8)()
    with pytest.raises(TypeError, match="corrupt memory"):
        fake.nvmlDeviceGetGpuInstancePossiblePlacements(device, 9, wrong, ctypes.byref(count))
