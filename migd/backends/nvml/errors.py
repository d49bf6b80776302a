"""NVML error translation: every NVML error migd sees becomes a :mod:`migd.errors` error here.

:func:`nvml_errors` wraps each NVML call of the backend; :func:`translate_nvml_error`
maps one return code (names and values in :mod:`migd.backends.nvml_codes`) to the error a
caller can act on, with a hint. Also here: telling pynvml's library-mismatch error (an
unversioned wrapper meeting an older driver) from an NVML return code, and the
``version=2`` -> ``version=1`` fallback of profile-info queries that it calls for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from migd.backends.nvml_codes import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_GPU_NOT_FOUND,
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH,
    NVML_ERROR_LIBRARY_NOT_FOUND,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_RESET_REQUIRED,
    NVML_ERROR_TIMEOUT,
    NVML_ERROR_UNINITIALIZED,
    error_name,
)
from migd.errors import (
    DriverUnavailable,
    GpuBusy,
    GpuError,
    GpuNotFound,
    GpuPermissionDenied,
    GpuUnsupported,
    InsufficientResources,
    MigdError,
    MigModeError,
)

# Reads a GPU's (current, pending) MIG mode, for telling NOT_SUPPORTED apart.
MigModeReader = Callable[[], tuple[bool | None, bool | None]]


def nvml_error_code(exc: BaseException) -> int | None:
    """The NVML return code of a ``pynvml.NVMLError`` (real or simulated), else ``None``."""
    value = getattr(exc, "value", None)
    if isinstance(value, int) and any(c.__name__ == "NVMLError" for c in type(exc).__mro__):
        return value
    return None


def translate_nvml_error(
    code: int,
    *,
    op: str,
    gpu: int | None = None,
    mig_mode: MigModeReader | None = None,
    not_found: type[MigdError] = GpuNotFound,
    invalid_argument: type[MigdError] = GpuError,
    **details: Any,
) -> MigdError:
    """Map one NVML return code to the migd error a caller can act on.

    Args:
        code: the NVML return code.
        op: what was being done, e.g. ``"create 3g.20gb at unit 4"``.
        gpu: GPU index, for the message and details.
        mig_mode: reads (current, pending) MIG mode; used to tell "MIG disabled" or
            "pending a reset" from "not supported" when NVML says NOT_SUPPORTED.
        not_found: the error for NVML_ERROR_NOT_FOUND (e.g. ``InstanceNotFound``
            when looking up a GPU instance by id).
        invalid_argument: the error for NVML_ERROR_INVALID_ARGUMENT (e.g.
            ``InvalidStart`` for a placement start the profile does not allow).
        **details: structured context for the error.
    """
    name = error_name(code)
    where = f" on GPU {gpu}" if gpu is not None else ""
    message = f"{op}{where} failed: {name}"
    info: dict[str, Any] = {"op": op, "nvml_error": name, **details}
    if gpu is not None:
        info["gpu"] = gpu
    if code == NVML_ERROR_NO_PERMISSION:
        return GpuPermissionDenied(message, **info)
    if code == NVML_ERROR_INSUFFICIENT_RESOURCES:
        return InsufficientResources(message, **info)
    if code == NVML_ERROR_IN_USE:
        return GpuBusy(message, **info)
    if code == NVML_ERROR_TIMEOUT:
        return GpuBusy(
            message, hint="the driver timed out; retry, and check `dmesg` if it persists", **info
        )
    if code == NVML_ERROR_RESET_REQUIRED:
        return MigModeError(
            message,
            hint="reset the GPU (`nvidia-smi -r -i N`, idle GPU "
            "only) or reboot to apply the pending MIG mode",
            **info,
        )
    if code == NVML_ERROR_NOT_SUPPORTED:
        return _not_supported(message, mig_mode, info)
    if code in (
        NVML_ERROR_LIBRARY_NOT_FOUND,
        NVML_ERROR_DRIVER_NOT_LOADED,
        NVML_ERROR_UNINITIALIZED,
    ):
        return DriverUnavailable(message, **info)
    if code == NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return DriverUnavailable(
            message,
            hint="the NVIDIA library and kernel module differ "
            "(driver upgraded without reboot): reboot the node",
            **info,
        )
    if code == NVML_ERROR_FUNCTION_NOT_FOUND:
        return GpuUnsupported(
            message,
            hint="the NVIDIA driver is older than this NVML call; upgrade the driver",
            **info,
        )
    if code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_GPU_NOT_FOUND):
        return GpuNotFound(message, **info)
    if code == NVML_ERROR_NOT_FOUND:
        return not_found(message, **info)
    if code == NVML_ERROR_INVALID_ARGUMENT:
        return invalid_argument(message, **info)
    return GpuError(message, hint="`nvidia-smi -q -i N` and `dmesg` may say more", **info)


def _not_supported(message: str, mig_mode: MigModeReader | None, info: dict[str, Any]) -> MigdError:
    current: bool | None = True
    pending: bool | None = True
    if mig_mode is not None:
        try:
            current, pending = mig_mode()
        except MigdError:  # the mode cannot be read either: say what we know
            current = pending = True
    if current is None:
        return GpuUnsupported(
            f"{message} (this GPU has no MIG)",
            hint="use the GPU whole (MPS only), or leave it out of migd.toml",
            **info,
        )
    if not current and pending:
        return MigModeError(
            f"{message} (MIG enabling is pending a GPU reset)",
            hint="reset the GPU (`nvidia-smi -r -i N`) or reboot the node",
            **info,
        )
    if not current:
        return MigModeError(f"{message} (MIG is disabled)", **info)
    return GpuUnsupported(
        f"{message} (not supported by this GPU or driver)",
        hint="`nvidia-smi mig -lgip` lists what the driver supports",
        **info,
    )


def nvml_errors(
    op: str,
    *,
    gpu: int | None = None,
    mig_mode: MigModeReader | None = None,
    not_found: type[MigdError] = GpuNotFound,
    invalid_argument: type[MigdError] = GpuError,
    **details: Any,
) -> NvmlErrors:
    """Translate NVML errors raised in the block (see :func:`translate_nvml_error`).

    migd errors and non-NVML exceptions pass through unchanged.
    """
    return NvmlErrors(op, gpu, mig_mode, not_found, invalid_argument, details)


@dataclass(slots=True)
class NvmlErrors:
    """The context manager :func:`nvml_errors` returns. A class, not a generator
    ``@contextmanager``: it wraps every NVML call, and a generator-based one costs about
    2 us more per call (a process listing makes three, issue 26 §4)."""

    op: str
    gpu: int | None
    mig_mode: MigModeReader | None
    not_found: type[MigdError]
    invalid_argument: type[MigdError]
    details: dict[str, Any]

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Returns None, never True: what is not translated propagates (and mypy knows the
        # block's exceptions are never swallowed).
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, MigdError):
            return  # nothing raised, or not ours to translate
        code = nvml_error_code(exc)
        if code is None and is_library_mismatch(exc):
            raise GpuUnsupported(
                f"{self.op} failed: the NVIDIA driver is older than this pynvml call ({exc})",
                hint="upgrade the driver, or install the nvidia-ml-py release of its branch",
                op=self.op,
                gpu=self.gpu,
            ) from exc
        if code is None:
            return
        raise translate_nvml_error(
            code,
            op=self.op,
            gpu=self.gpu,
            mig_mode=self.mig_mode,
            not_found=self.not_found,
            invalid_argument=self.invalid_argument,
            **self.details,
        ) from exc


def is_library_mismatch(exc: BaseException) -> bool:
    # pynvml raises NVMLLibraryMismatchError (not an NVMLError) when an unversioned
    # wrapper meets a driver without the newest versioned function (pynvml.py:1033).
    return type(exc).__name__ == "NVMLLibraryMismatchError"


def versioned_info(function: Callable[..., Any], *args: Any) -> Any:
    """A profile-info query as ``version=2`` (with the name), else ``version=1``.

    pynvml's default ``version=2`` needs the driver's ``...ProfileInfoV`` entry point;
    an older driver answers FUNCTION_NOT_FOUND, and the v1 structure has no name.
    """
    try:
        return function(*args)
    except Exception as exc:
        if nvml_error_code(exc) != NVML_ERROR_FUNCTION_NOT_FOUND:
            raise
        return function(*args, version=1)
