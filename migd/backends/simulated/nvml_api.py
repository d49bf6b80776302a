"""The pieces of the ``pynvml`` API the simulator reproduces: constants, errors, ctypes types.

Values, class names and structure layouts are copied from ``pynvml.py`` of
``nvidia-ml-py`` 13.615.71 (lines cited below), so code written against
``pynvml`` behaves the same against :class:`~migd.backends.simulated.fake_pynvml.FakePynvml`.
``tests/backends/test_fake_pynvml.py`` compares every name defined here with the
installed ``pynvml`` (values, field names and sizes), so a drift fails a test
instead of hiding a bug. This module does not import ``pynvml``: the simulator
must work where the NVIDIA bindings are absent.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_char, c_uint, c_ulonglong
from typing import Any, ClassVar

# Return codes (pynvml.py:223-254) and error_name: one table, shared with the NVML backend
# (the names are this module's too, as in pynvml).
from migd.backends.nvml_codes import *  # noqa: F403
from migd.backends.nvml_codes import ERROR_STRINGS

# -- flags and enums (pynvml.py:465, 2794-2881) --------------------------------------------------

NVML_INIT_FLAG_NO_GPUS = 1 << 0
NVML_INIT_FLAG_NO_ATTACH = 1 << 1

NVML_DEVICE_MIG_DISABLE = 0x0
NVML_DEVICE_MIG_ENABLE = 0x1

NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_GPU_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_GPU_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_GPU_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_GPU_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_GPU_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_GPU_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1 = 0x8
NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2 = 0x9
NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX = 0xA
NVML_GPU_INSTANCE_PROFILE_2_SLICE_GFX = 0xB
NVML_GPU_INSTANCE_PROFILE_4_SLICE_GFX = 0xC
NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME = 0xD
NVML_GPU_INSTANCE_PROFILE_2_SLICE_NO_ME = 0xE
NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME = 0xF
NVML_GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME = 0x10
NVML_GPU_INSTANCE_PROFILE_3_SLICE_GFX = 0x11
NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12

NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE = 0x0
NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE = 0x1
NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE = 0x2
NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE = 0x3
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE = 0x4
NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE = 0x5
NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE = 0x6
NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1 = 0x7
NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE_NVL = 0x8
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x9

NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0x0
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT = 0x1

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_COMPUTEMODE_DEFAULT = 0
NVML_COMPUTEMODE_EXCLUSIVE_THREAD = 1
NVML_COMPUTEMODE_PROHIBITED = 2
NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = 3

NVML_DEVICE_NAME_V2_BUFFER_SIZE = 96
NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE = 32
NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE = 16

# Version words of the versioned structures (pynvml.py: nvmlGpuInstanceProfileInfo_v2 etc.).
nvmlGpuInstanceProfileInfo_v2 = 0x02000098
nvmlComputeInstanceProfileInfo_v2 = 0x02000088
nvmlMemory_v2 = 0x02000028

# gpuInstanceId/computeInstanceId of a process outside MIG (NVML_VALUE_NOT_AVAILABLE_uint).
VALUE_NOT_AVAILABLE_UINT = 0xFFFFFFFF


# -- errors (pynvml.py:1037-1112) ----------------------------------------------------------------


class NVMLError(Exception):
    """Same contract as ``pynvml.NVMLError``: ``NVMLError(code)`` builds the code's subclass.

    ``value`` is the NVML return code. As in pynvml, errors compare equal by code.
    """

    _valClassMapping: ClassVar[dict[int, type[NVMLError]]] = {}
    value: int

    def __new__(cls, value: int) -> NVMLError:
        chosen = NVMLError._valClassMapping.get(value, cls) if cls is NVMLError else cls
        obj = Exception.__new__(chosen)
        obj.value = value
        return obj

    def __init__(self, *args: object) -> None:
        super().__init__(*args)

    def __str__(self) -> str:
        return ERROR_STRINGS.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NVMLError) and self.value == other.value

    __hash__ = Exception.__hash__


class NVMLLibraryMismatchError(Exception):
    """pynvml raises this (not an NVMLError) when an unversioned wrapper meets an older driver."""


def _error_class_name(constant: str) -> str:
    # pynvml: "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
    words = constant.removeprefix("NVML_ERROR_").split("_")
    return "NVMLError_" + "".join(w.capitalize() for w in words)


def _fixed_code_new(code: int) -> Any:
    # pynvml's generated subclasses can be raised bare (``raise NVMLError_InUse()``) and
    # always carry their own code.
    def __new__(cls: type[NVMLError], *args: object) -> NVMLError:
        obj = Exception.__new__(cls)
        obj.value = code
        return obj

    return __new__


ERROR_CLASSES: dict[str, type[NVMLError]] = {}
for _name, _value in list(globals().items()):
    if _name.startswith("NVML_ERROR_") and isinstance(_value, int):
        _cls = type(
            _error_class_name(_name),
            (NVMLError,),
            {"__new__": _fixed_code_new(_value), "__module__": __name__},
        )
        ERROR_CLASSES[_cls.__name__] = _cls
        NVMLError._valClassMapping[_value] = _cls
globals().update(ERROR_CLASSES)


# -- ctypes structures (pynvml.py:1179-1447, 2817-2928) ------------------------------------------


class _PrintableStructure(Structure):
    """Like pynvml's: ``char[]`` fields read back as ``str``, ``str`` assignments are encoded."""

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if isinstance(value, bytes):
            return value.decode()
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, str):
            value = value.encode()
        super().__setattr__(name, value)


class struct_c_nvmlDevice_t(Structure):
    pass  # opaque handle


c_nvmlDevice_t = POINTER(struct_c_nvmlDevice_t)


class struct_c_nvmlGpuInstance_t(Structure):
    pass  # opaque handle


c_nvmlGpuInstance_t = POINTER(struct_c_nvmlGpuInstance_t)


class struct_c_nvmlComputeInstance_t(Structure):
    pass  # opaque handle


c_nvmlComputeInstance_t = POINTER(struct_c_nvmlComputeInstance_t)


class nvmlPciInfo_t(_PrintableStructure):
    _fields_ = [
        ("busIdLegacy", c_char * NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE),
        ("domain", c_uint),
        ("bus", c_uint),
        ("device", c_uint),
        ("pciDeviceId", c_uint),
        ("pciSubSystemId", c_uint),
        ("busId", c_char * NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE),
    ]


class c_nvmlMemory_t(_PrintableStructure):
    _fields_ = [
        ("total", c_ulonglong),
        ("free", c_ulonglong),
        ("used", c_ulonglong),
    ]


class c_nvmlMemory_v2_t(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("total", c_ulonglong),
        ("reserved", c_ulonglong),
        ("free", c_ulonglong),
        ("used", c_ulonglong),
    ]


class c_nvmlProcessInfo_v2_t(_PrintableStructure):
    _fields_ = [
        ("pid", c_uint),
        ("usedGpuMemory", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    ]


c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t


class c_nvmlGpuInstancePlacement_t(Structure):
    _fields_ = [("start", c_uint), ("size", c_uint)]


class c_nvmlGpuInstanceProfileInfo_t(Structure):
    _fields_ = [
        ("id", c_uint),
        ("isP2pSupported", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("copyEngineCount", c_uint),
        ("decoderCount", c_uint),
        ("encoderCount", c_uint),
        ("jpegCount", c_uint),
        ("ofaCount", c_uint),
        ("memorySizeMB", c_ulonglong),
    ]


class c_nvmlGpuInstanceProfileInfo_v2_t(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("id", c_uint),
        ("isP2pSupported", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("copyEngineCount", c_uint),
        ("decoderCount", c_uint),
        ("encoderCount", c_uint),
        ("jpegCount", c_uint),
        ("ofaCount", c_uint),
        ("memorySizeMB", c_ulonglong),
        ("name", c_char * NVML_DEVICE_NAME_V2_BUFFER_SIZE),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlGpuInstanceProfileInfo_v2)


class c_nvmlGpuInstanceInfo_t(Structure):
    _fields_ = [
        ("device", c_nvmlDevice_t),
        ("id", c_uint),
        ("profileId", c_uint),
        ("placement", c_nvmlGpuInstancePlacement_t),
    ]


class c_nvmlComputeInstancePlacement_t(Structure):
    _fields_ = [("start", c_uint), ("size", c_uint)]


class c_nvmlComputeInstanceProfileInfo_t(Structure):
    _fields_ = [
        ("id", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
    ]


class c_nvmlComputeInstanceProfileInfo_v2_t(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("id", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
        ("name", c_char * NVML_DEVICE_NAME_V2_BUFFER_SIZE),
    ]

    def __init__(self) -> None:
        super().__init__(version=nvmlComputeInstanceProfileInfo_v2)


class c_nvmlComputeInstanceInfo_t(Structure):
    _fields_ = [
        ("device", c_nvmlDevice_t),
        ("gpuInstance", c_nvmlGpuInstance_t),
        ("id", c_uint),
        ("profileId", c_uint),
        ("placement", c_nvmlComputeInstancePlacement_t),
    ]


class nvmlFriendlyObject:
    """pynvml's plain attribute bag (returned for process lists)."""

    def __init__(self, dictionary: dict[str, Any]) -> None:
        for key, value in dictionary.items():
            setattr(self, key, value)

    def __str__(self) -> str:
        return str(self.__dict__)


def pointer_token(pointer: Any) -> int | None:
    """The address a ctypes pointer holds (``None`` for NULL or a non-pointer)."""
    if isinstance(pointer, ctypes._Pointer):
        # The pointer's own 8 bytes read as a void*: what ctypes.cast gives, without
        # cast's foreign-function call (a third of the cost of a fake NVML call).
        return ctypes.c_void_p.from_buffer(pointer).value
    try:
        value: int | None = ctypes.cast(pointer, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None
    return value
