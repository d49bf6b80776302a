"""Did a job die of GPU out-of-memory? Classification from exit status, stderr and usage.

The wrapper tees the job's stderr through a :class:`TailBuffer` and, when the job
exits, asks :func:`classify_exit` with the exit status, the tail, and migd's peak
NVML usage of the job against its partition (MIG instance memory or MPS per-client
limit). The answer decides what happens next (reference
``htcondor-mps-nvml.md`` §6):

``strong``
    the job exited non-zero and its stderr ends in a GPU allocation failure
    (:data:`SIGNATURES`): restart on a bigger partition.
``weak``
    non-zero exit, no signature, but peak usage reached ``weak_fraction`` (97%) of
    the partition; or only an ambiguous signature; or an OOM message followed by a
    different fatal error while peak usage was near the limit
    (``corroborate_fraction``): at most ``OomPolicy.weak_retries`` (1) retry bigger,
    after which the job's own exit status stands.
``mps_unavailable``
    the CUDA client could not attach ("all CUDA-capable devices are busy or
    unavailable", MPS connection errors): not a memory problem; report it, the
    partition is broken or the MPS server is down.
``none``
    anything else, in particular: exit 0 (frameworks catch OOM and retry smaller,
    e.g. batch-size finders), a kill by SIGKILL/SIGTERM/exit 137 (host-RAM OOM
    killer or HTCondor removal: HTCondor handles those itself), host-memory errors
    (``MemoryError``, ``std::bad_alloc``, TensorFlow's CPU allocator, a DataLoader
    worker "killed by signal: Killed").

False positives cost a bigger partition for nothing, so a signature only counts on
a line that is the error itself: not in an echoed shell command (``+ grep ...``,
``grep "CUDA out of memory" log``), not in a source line a traceback quotes, not
inside a quoted string (except an exception's repr ``Error('...')`` or a logged
``key: "value"``), and not when a *different* fatal exception came after it
without the "During handling of the above exception" chaining (the job survived
the OOM and died of something else: ``weak`` when peak usage was near the limit,
else ``none``, and ``none`` when the peak is unknown). When several signatures
match, the last one in the tail decides: Python prints the fatal error last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from migd.errors import ConfigError

OomKind = Literal["strong", "weak", "none", "mps_unavailable"]
Meaning = Literal["oom", "oom_if_corroborated", "mps_unavailable", "host_memory"]


@dataclass(frozen=True, slots=True)
class Signature:
    """One recognisable failure message.

    Attributes:
        name: stable identifier (logged and reported to migd).
        pattern: regular expression searched in each stderr line.
        meaning: ``oom`` (GPU allocation failed), ``oom_if_corroborated`` (often an
            OOM, but ambiguous: strong only with high peak usage), ``mps_unavailable``
            or ``host_memory`` (host RAM, not the GPU).
        source: where the message comes from.
        example: a real line of that kind (used by the tests).
    """

    name: str
    pattern: re.Pattern[str]
    meaning: Meaning
    source: str
    example: str


def _sig(name: str, regex: str, meaning: Meaning, source: str, example: str) -> Signature:
    return Signature(name, re.compile(regex), meaning, source, example)


# Order matters only between signatures that can match the same line: the first
# match of a line wins, so specific host-side variants precede the generic GPU ones.
SIGNATURES: tuple[Signature, ...] = (
    _sig(
        "tf_cpu_oom",
        r"OOM when allocating tensor.*(?:device:CPU|allocator cpu)",
        "host_memory",
        "TensorFlow op_kernel.cc ResourceExhausted on the CPU device: host RAM",
        "ResourceExhaustedError: OOM when allocating tensor with shape[1024,1024,256] and type "
        "float on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
    ),
    _sig(
        "torch_oom",
        r"\b(?:torch\.(?:cuda\.)?)?OutOfMemoryError: CUDA out of memory",
        "oom",
        "PyTorch >= 1.13 c10/cuda/CUDACachingAllocator.cpp TORCH_CHECK_WITH(OutOfMemoryError); "
        "torch.cuda.OutOfMemoryError (torch.OutOfMemoryError from 2.4)",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 9.75 GiB of which 3.06 MiB is free. Including non-PyTorch memory, "
        "this process has 9.74 GiB memory in use.",
    ),
    _sig(
        "torch_oom_legacy",
        r"RuntimeError: CUDA out of memory",
        "oom",
        "PyTorch < 1.13 caching allocator (RuntimeError)",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 9.75 GiB total "
        "capacity; 7.12 GiB already allocated; 1.02 GiB free; 7.80 GiB reserved in total by "
        "PyTorch)",
    ),
    _sig(
        "torch_oom_message",
        r"CUDA out of memory\. Tried to allocate",
        "oom",
        "PyTorch allocator message re-raised or logged under another type (Lightning, "
        "accelerate, Ray)",
        "ray.exceptions.RayTaskError(OutOfMemoryError): ray::train() CUDA out of memory. Tried "
        "to allocate 1.50 GiB.",
    ),
    _sig(
        "cuda_error_oom",
        r"CUDA error: out of memory",
        "oom",
        "cudaGetErrorString(cudaErrorMemoryAllocation) through PyTorch C10_CUDA_CHECK "
        "(RuntimeError / torch.AcceleratorError): allocations outside the caching allocator",
        "RuntimeError: CUDA error: out of memory",
    ),
    _sig(
        "cuda_oom_code",
        r"\bCUDA_ERROR_OUT_OF_MEMORY\b|\bcudaErrorMemoryAllocation\b",
        "oom",
        "CUDA driver/runtime enum names (code 2): cuda-python, CuPy, Numba, TensorFlow",
        "numba.cuda.cudadrv.driver.CudaAPIError: [2] Call to cuMemAlloc results in "
        "CUDA_ERROR_OUT_OF_MEMORY",
    ),
    _sig(
        "cupy_oom",
        r"cupy\.cuda\.memory\.OutOfMemoryError: Out of memory allocating",
        "oom",
        "CuPy memory pool (cupy/cuda/memory.pyx)",
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 4,294,967,296 bytes "
        "(allocated so far: 5,368,709,120 bytes).",
    ),
    _sig(
        "cudamalloc_failed",
        r"cudaMalloc(?:Async)? failed: out of memory|Cuda failure '?out of memory",
        "oom",
        "ggml/llama.cpp CUDA backend; NCCL include/alloc.h 'Cuda failure'",
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 13285.50 MiB on device 0: "
        "cudaMalloc failed: out of memory",
    ),
    _sig(
        "cublas_alloc",
        r"\bCUBLAS_STATUS_ALLOC_FAILED\b",
        "oom",
        "cuBLAS handle/workspace allocation (PyTorch CUDABlas.cpp)",
        "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    ),
    _sig(
        "cudnn_alloc",
        r"\bCUDNN_STATUS_ALLOC_FAILED\b",
        "oom",
        "cuDNN workspace allocation",
        "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    ),
    _sig(
        "tf_oom",
        r"OOM when allocating tensor",
        "oom",
        "TensorFlow core/framework/op_kernel.cc errors::ResourceExhausted on a GPU device",
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating "
        "tensor with shape[8192,8192] and type float on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc",
    ),
    _sig(
        "xla_oom",
        r"RESOURCE_EXHAUSTED: (?:Out of memory|Failed to allocate request for)",
        "oom",
        "JAX/XLA (XlaRuntimeError / JaxRuntimeError) BFC allocator",
        "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying "
        "to allocate 17179869184 bytes.",
    ),
    _sig(
        "vllm_no_kv_memory",
        r"No available memory for the cache blocks",
        "oom",
        "vLLM worker: weights + activations leave no room for the KV cache",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
    ),
    _sig(
        "cudnn_not_initialized",
        r"\bCUDNN_STATUS_NOT_INITIALIZED\b|\bCUBLAS_STATUS_NOT_INITIALIZED\b",
        "oom_if_corroborated",
        "handle creation failing under memory pressure, but also on library/driver mismatch",
        "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_INITIALIZED",
    ),
    _sig(
        "tf_bfc_warning",
        r"Allocator \(GPU_\d+_bfc\) ran out of memory trying to allocate",
        "oom_if_corroborated",
        "TensorFlow BFC allocator warning: TensorFlow may still recover from it",
        "W tensorflow/core/common_runtime/bfc_allocator.cc:290] Allocator (GPU_0_bfc) ran out "
        "of memory trying to allocate 2.00GiB with freed_by_count=0.",
    ),
    _sig(
        "devices_unavailable",
        r"CUDA-capable device(?:s|\(s\))? (?:is|are|is/are) busy or unavailable"
        r"|\bcudaErrorDevicesUnavailable\b|\bCUDA_ERROR_DEVICE_UNAVAILABLE\b",
        "mps_unavailable",
        "cudaErrorDevicesUnavailable: the MPS server is unreachable or full, or an "
        "exclusive-process GPU is held by another process",
        "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable",
    ),
    _sig(
        "mps_client_cap",
        r"hardware resources required to create MPS client have been exhausted"
        r"|\bcudaErrorMpsMaxClientsReached\b|\bCUDA_ERROR_MPS_MAX_CLIENTS_REACHED\b",
        "mps_unavailable",
        "CUDA error 808: the MPS server is at its client cap (48 on an H100, recorded)",
        "cuCtxCreate: CUDA error 808 (the hardware resources required to create MPS client "
        "have been exhausted)",
    ),
    _sig(
        "mps_error",
        r"\b(?:cudaErrorMps\w+|CUDA_ERROR_MPS_\w+)\b"
        r"|MPS client failed to connect to the MPS control daemon",
        "mps_unavailable",
        "CUDA MPS error codes 805-810 (connection, RPC, server not ready, client limits)",
        "cudaErrorMpsConnectionFailed: MPS client failed to connect to the MPS control daemon "
        "or the MPS server",
    ),
    _sig(
        "dataloader_killed",
        r"killed by signal: Killed",
        "host_memory",
        "PyTorch DataLoader worker SIGKILLed (host-RAM OOM killer)",
        "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.",
    ),
    _sig(
        "shell_killed",
        r"^(?:.*line \d+: +\d+ )?Killed(?:\s|$)",
        "host_memory",
        "bash job control reporting a SIGKILLed child (host-RAM OOM killer)",
        "./run.sh: line 3: 12345 Killed                  python train.py",
    ),
    _sig(
        "host_memory_error",
        r"^(?:[\w.]*\.)?(?:_ArrayMemoryError|MemoryError)\b|std::bad_alloc"
        r"|Cannot allocate memory",
        "host_memory",
        "Python MemoryError, numpy _ArrayMemoryError, C++ std::bad_alloc, ENOMEM",
        "numpy.core._exceptions._ArrayMemoryError: Unable to allocate 74.5 GiB for an array",
    ),
)

# SIGHUP, SIGINT, SIGQUIT, SIGKILL, SIGTERM, SIGXCPU: the job was stopped from outside
# (HTCondor removal/eviction, host OOM killer, a user), never a GPU allocation failure.
DEFAULT_EXTERNAL_SIGNALS = frozenset({1, 2, 3, 9, 15, 24})
_SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 3: "SIGQUIT", 9: "SIGKILL", 15: "SIGTERM", 24: "SIGXCPU"}


@dataclass(frozen=True)
class OomPolicy:
    """Thresholds of the classification.

    Attributes:
        weak_fraction: peak usage / limit from which a non-zero exit without a
            signature counts as a weak OOM (reference §6: ~97%).
        corroborate_fraction: peak usage / limit from which an ambiguous signature
            (``oom_if_corroborated``) counts as strong.
        weak_retries: how many times a job may be restarted bigger on ``weak``
            evidence (reference §6: at most one); after that the job's own exit
            status is passed through.
        external_signals: signals that mean "stopped from outside" (also recognised as
            shell exit codes ``128 + n``).
        signatures: the table to match.

    Raises:
        ConfigError: a fraction outside (0, 1] or a negative retry count.
    """

    weak_fraction: float = 0.97
    corroborate_fraction: float = 0.90
    weak_retries: int = 1
    external_signals: frozenset[int] = DEFAULT_EXTERNAL_SIGNALS
    signatures: tuple[Signature, ...] = SIGNATURES

    def __post_init__(self) -> None:
        for name in ("weak_fraction", "corroborate_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise ConfigError(
                    f"must be a fraction in (0, 1], got {value!r}", where=f"oom.{name}"
                )
        retries = self.weak_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(
                f"must be a whole number >= 0, got {retries!r}", where="oom.weak_retries"
            )


@dataclass(frozen=True)
class OomVerdict:
    """The classification of one job exit.

    Attributes:
        kind: ``strong``, ``weak``, ``none`` or ``mps_unavailable``.
        matched: the stderr line that decided it (trimmed), or ``None``.
        reason: one line for logs and ``migctl status``.
        signature: the :class:`Signature` name that matched, or ``None``.
        tried_mib: the allocation that failed, when the message says (PyTorch
            "Tried to allocate", XLA "trying to allocate N bytes", ...).
        peak_fraction: peak usage / limit, when both were given.
        held_mib: what the process already held when the allocation failed, when the
            message says (PyTorch "already allocated", "memory in use"): a lower bound
            of its peak usage.
    """

    kind: OomKind
    matched: str | None
    reason: str
    signature: str | None = None
    tried_mib: float | None = None
    peak_fraction: float | None = None
    held_mib: float | None = None

    @property
    def is_oom(self) -> bool:
        """True for ``strong`` and ``weak``: a bigger partition may help."""
        return self.kind in ("strong", "weak")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "signature": self.signature,
            "matched": self.matched,
            "tried_mib": None if self.tried_mib is None else round(self.tried_mib, 1),
            "peak_fraction": None if self.peak_fraction is None else round(self.peak_fraction, 4),
            "held_mib": None if self.held_mib is None else round(self.held_mib, 1),
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class SignatureMatch:
    """A signature found on one line of the tail (``line`` is 0-based)."""

    signature: Signature
    line: int
    text: str


# -- text handling --------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_XTRACE = re.compile(r"^\s*(?:\++ |\$ )")
_COMMAND_WORD = re.compile(r"\b(?:grep|egrep|fgrep|zgrep|rg|awk|sed|echo|printf)\b")
_TRACEBACK_FILE = re.compile(r'^\s*File "[^"]*", line \d+')
_FINAL_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b")
_CHAINING = (
    "During handling of the above exception, another exception occurred",
    "The above exception was the direct cause of the following exception",
)
# Exceptions that carry a child's failure up (launchers): the OOM is still the cause.
_PROPAGATING = re.compile(
    r"ChildFailedError|CalledProcessError|RayTaskError|WorkerError|ProcessRaisedException"
)
_SIZE_UNITS = {"b": 1 / 1048576, "kib": 1 / 1024, "kb": 1 / 1024, "mib": 1.0, "mb": 1.0}
_SIZE_UNITS |= {"gib": 1024.0, "gb": 1024.0, "tib": 1048576.0, "tb": 1048576.0}
_TRIED = re.compile(
    r"(?:Tried to allocate|trying to allocate|Failed to allocate request for|allocating)\s+"
    r"([\d.,]+)\s*(B|bytes|[KMGT]i?B)\b",
    re.IGNORECASE,
)


def _lines(stderr_tail: bytes | str) -> list[str]:
    text = (
        stderr_tail.decode("utf-8", errors="replace")
        if isinstance(stderr_tail, bytes | bytearray)
        else str(stderr_tail)
    )
    text = _ANSI.sub("", text)
    # tqdm and friends redraw with \r: each redraw is a line of its own.
    return re.split(r"\r\n|\r|\n", text)


def _inside_quotes(line: str, pos: int) -> int | None:
    """Index of the quote that opens a string around ``pos``, or ``None``.

    An apostrophe between two letters (``can't``) is not a quote.
    """
    open_at: int | None = None
    quote = ""
    i = 0
    while i < pos:
        ch = line[i]
        if ch == "\\":
            i += 2
            continue
        if open_at is None:
            apostrophe = 0 < i < len(line) - 1 and line[i - 1].isalpha() and line[i + 1].isalpha()
            if ch == '"' or (ch == "'" and not apostrophe):
                open_at, quote = i, ch
        elif ch == quote:
            open_at = None
        i += 1
    return open_at


def _is_quoted_or_echoed(lines: list[str], index: int, start: int) -> bool:
    """True when the match is a mention of the message, not the message itself."""
    line = lines[index]
    if _XTRACE.match(line) or _COMMAND_WORD.search(line[:start]):
        return True
    if index > 0 and _TRACEBACK_FILE.match(lines[index - 1]) and line[:1].isspace():
        # A source line quoted by a Python traceback is indented under its File line.
        # Without source (python -c, .pyc-only installs) the next unindented line is
        # the exception itself and must count.
        return True
    opened = _inside_quotes(line, start)
    if opened is None:
        return False
    before = line[:opened].rstrip()
    # An exception repr or a logged value is the real error: Error('...'), msg: "...".
    return not (before.endswith(("Error(", "Exception(", ":", "=")))


def find_signatures(
    stderr_tail: bytes | str, signatures: tuple[Signature, ...] = SIGNATURES
) -> list[SignatureMatch]:
    """All lines of the tail that carry a failure signature, in order.

    Each line yields at most one match (the first signature of the table that
    matches); quoted or echoed mentions are skipped.
    """
    lines = _lines(stderr_tail)
    found: list[SignatureMatch] = []
    for index, line in enumerate(lines):
        for signature in signatures:
            match = signature.pattern.search(line)
            if match is None:
                continue
            if _is_quoted_or_echoed(lines, index, match.start()):
                break
            found.append(SignatureMatch(signature, index, line.strip()[:400]))
            break
    return found


_SIZE = r"([\d.,]+)\s*(B|bytes|[KMGT]i?B)"
# What the process held when the allocation failed, as PyTorch words it (1.x: "7.12 GiB
# already allocated; ... 7.80 GiB reserved in total by PyTorch"; 2.x: "this process has
# 79.13 GiB memory in use. Of the allocated memory 78.44 GiB is allocated by PyTorch, and
# 176.05 MiB is reserved by PyTorch but unallocated").
_HELD = {
    "allocated": re.compile(_SIZE + r"\s+already allocated", re.IGNORECASE),
    "reserved": re.compile(_SIZE + r"\s+reserved in total", re.IGNORECASE),
    "in_use": re.compile(r"this process has\s+" + _SIZE + r"\s+memory in use", re.IGNORECASE),
    "by_framework": re.compile(
        r"Of the allocated memory\s+" + _SIZE + r"\s+is allocated by", re.IGNORECASE
    ),
    "cached": re.compile(_SIZE + r"\s+is reserved by \w+ but unallocated", re.IGNORECASE),
}


def _size_mib(number: str, unit: str) -> float | None:
    try:
        value = float(number.replace(",", ""))
    except ValueError:
        return None
    factor = _SIZE_UNITS.get("b" if unit.lower() == "bytes" else unit.lower())
    return None if factor is None else value * factor


def held_mib(text: str) -> float | None:
    """What the process already held when its allocation failed (MiB), when the message
    says: the largest of its figures (in use; allocated plus cached; reserved)."""
    found: dict[str, float] = {}
    for name, pattern in _HELD.items():
        match = pattern.search(text)
        if match is not None:
            size = _size_mib(match.group(1), match.group(2))
            if size is not None:
                found[name] = size
    if "by_framework" in found:
        found["by_framework"] += found.pop("cached", 0.0)
    found.pop("cached", None)
    return max(found.values()) if found else None


def tried_mib(text: str) -> float | None:
    """The failed allocation's size in MiB when the message states it."""
    match = _TRIED.search(text)
    if match is None:
        return None
    try:
        number = float(match.group(1).replace(",", ""))
    except ValueError:
        return None
    unit = match.group(2).lower()
    factor = _SIZE_UNITS.get("b" if unit == "bytes" else unit)
    return None if factor is None else number * factor


def _later_fatal_error(lines: list[str], after: int, policy: OomPolicy) -> str | None:
    """A different fatal exception after line ``after`` that the OOM did not cause."""
    chained = False
    for line in lines[after + 1 :]:
        if any(marker in line for marker in _CHAINING):
            chained = True
            continue
        if not _FINAL_EXCEPTION.match(line) or _PROPAGATING.search(line):
            continue
        if any(s.pattern.search(line) for s in policy.signatures):
            continue
        if not chained:
            return line.strip()[:400]
    return None


# -- classification -------------------------------------------------------------------------


def _external_signal(exit_code: int | None, signal: int | None, policy: OomPolicy) -> int | None:
    if signal is not None and signal in policy.external_signals:
        return signal
    if exit_code is not None:
        if exit_code < 0 and -exit_code in policy.external_signals:
            return -exit_code  # subprocess.Popen.returncode convention
        if exit_code > 128 and exit_code - 128 in policy.external_signals:
            return exit_code - 128  # shell convention: 137 = 128 + SIGKILL
    return None


def classify_exit(
    exit_code: int | None,
    signal: int | None,
    stderr_tail: bytes | str,
    peak_used_mib: int | None,
    limit_mib: int | None,
    *,
    policy: OomPolicy | None = None,
) -> OomVerdict:
    """Classify a job's exit as a GPU out-of-memory failure (or not).

    Args:
        exit_code: the exit status if the job exited (``os.WEXITSTATUS``), else
            ``None``; negative values are read as ``-signal`` (``Popen.returncode``).
        signal: the signal that killed the job (``os.WTERMSIG``), else ``None``.
        stderr_tail: the last bytes of the job's stderr (:class:`TailBuffer`).
        peak_used_mib: migd's peak NVML usage of the job, if known.
        limit_mib: the partition's memory (MIG instance or MPS per-client limit).
        policy: thresholds and signatures (defaults: :class:`OomPolicy`).

    Returns:
        The verdict; never raises on odd input (undecodable bytes, negative sizes).
    """
    policy = policy or OomPolicy()
    fraction: float | None = None
    if peak_used_mib is not None and limit_mib is not None and limit_mib > 0 and peak_used_mib >= 0:
        fraction = peak_used_mib / limit_mib
    peak_text = (
        f"peak {peak_used_mib} of {limit_mib} MiB" if fraction is not None else "peak unknown"
    )
    held: float | None = None  # from the OOM message, once one is found

    def verdict(
        kind: OomKind,
        reason: str,
        match: SignatureMatch | None = None,
        tried: float | None = None,
    ) -> OomVerdict:
        return OomVerdict(
            kind,
            None if match is None else match.text,
            reason,
            None if match is None else match.signature.name,
            tried,
            fraction,
            held,
        )

    if (exit_code is None or exit_code == 0) and not signal:
        if exit_code is None:
            return verdict("none", "no exit status (still running or unknown)")
        return verdict("none", "exited 0: any OOM it printed was handled by the job")

    external = _external_signal(exit_code, signal, policy)
    if external is not None:
        name = _SIGNAL_NAMES.get(external, f"signal {external}")
        return verdict(
            "none",
            f"killed by {name} from outside (host-RAM OOM killer, HTCondor removal or "
            "eviction): not a GPU OOM",
        )
    status = f"exit {exit_code}" if not signal else f"signal {signal}"

    lines = _lines(stderr_tail)
    matches = find_signatures(stderr_tail, policy.signatures)
    if matches:
        last = matches[-1]
        meaning = last.signature.meaning
        if meaning == "mps_unavailable":
            return verdict(
                "mps_unavailable",
                f"{status}: CUDA could not attach to the device ({last.signature.name}): MPS "
                "server unreachable or full, not an out-of-memory",
                last,
            )
        if meaning == "host_memory":
            return verdict(
                "none", f"{status}: host memory exhausted ({last.signature.name}), not GPU", last
            )
        tried = tried_mib(last.text)
        held = held_mib(last.text)
        if held is not None and (peak_used_mib is None or held > peak_used_mib):
            # The message's own figure is a lower bound of the peak: never "peak unknown"
            # (nor a sampled peak below it) when the job said what it held.
            peak_text = f"peak >= {held:.0f} MiB (held at the failure)"
            if limit_mib is not None and limit_mib > 0:
                fraction = held / limit_mib
                peak_text = f"peak >= {held:.0f} of {limit_mib} MiB (held at the failure)"
        later = _later_fatal_error(lines, last.line, policy)
        if later is not None:
            # The job survived the OOM (a batch-size finder, a retry) and died of
            # something else: a bigger partition helps only if memory was at the limit.
            near_limit = fraction is not None and fraction >= policy.corroborate_fraction
            return verdict(
                "weak" if near_limit else "none",
                f"{status}: {last.signature.name} was printed, but the job then failed "
                f"with {later[:120]!r}; {peak_text}"
                + (
                    f" (>= {policy.corroborate_fraction:.0%})"
                    if near_limit
                    else ": not an out-of-memory"
                ),
                last,
                tried,
            )
        if meaning == "oom_if_corroborated":
            if fraction is not None and fraction >= policy.corroborate_fraction:
                return verdict(
                    "strong",
                    f"{status}: {last.signature.name} with {peak_text} "
                    f"(>= {policy.corroborate_fraction:.0%})",
                    last,
                    tried,
                )
            return verdict(
                "weak",
                f"{status}: {last.signature.name} is ambiguous without high usage; {peak_text}",
                last,
                tried,
            )
        return verdict(
            "strong",
            f"{status}: GPU out of memory ({last.signature.name}); {peak_text}",
            last,
            tried,
        )

    if fraction is not None and fraction >= policy.weak_fraction:
        return verdict(
            "weak",
            f"{status} without an OOM message, but {peak_text} "
            f"(>= {policy.weak_fraction:.0%} of the partition)",
        )
    return verdict("none", f"{status} without an OOM message; {peak_text}")


# -- stderr tail ----------------------------------------------------------------------------


class TailBuffer:
    """The last ``max_bytes`` bytes of a stream, for classifying the job's exit.

    Pure and cheap: the wrapper feeds every chunk it tees from the job's stderr.
    The buffer grows to twice its size before trimming, so feeding many small
    chunks costs amortised O(chunk), not O(max_bytes).

    Raises:
        ValueError: ``max_bytes`` is not positive.
    """

    def __init__(self, max_bytes: int = 64 * 1024) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self.total_bytes = 0

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append ``chunk``, keeping only the last ``max_bytes`` bytes overall."""
        size = len(chunk)
        self.total_bytes += size
        if size >= self.max_bytes:
            self._buf = bytearray(chunk[size - self.max_bytes :])
            return
        self._buf += chunk
        if len(self._buf) > 2 * self.max_bytes:
            del self._buf[: len(self._buf) - self.max_bytes]

    @property
    def data(self) -> bytes:
        """The retained bytes (at most ``max_bytes``)."""
        return bytes(self._buf[-self.max_bytes :])

    @property
    def truncated(self) -> bool:
        """True when earlier bytes were dropped."""
        return self.total_bytes > self.max_bytes

    def text(self) -> str:
        """The retained bytes as text; a UTF-8 sequence cut at the start is dropped."""
        data = self.data
        if self.truncated:
            skip = 0
            while skip < min(3, len(data)) and data[skip] & 0xC0 == 0x80:
                skip += 1
            data = data[skip:]
        return data.decode("utf-8", errors="replace")

    def clear(self) -> None:
        self._buf.clear()
        self.total_bytes = 0

    def __len__(self) -> int:
        return min(len(self._buf), self.max_bytes)
