"""The local API: JSON messages over migd's Unix socket (version 1).

Framing: one JSON object per line (UTF-8, ``\\n``-terminated), at most
``api.max_message_bytes`` per line. Every request carries ``"version": 1`` and
an ``"op"``; every reply carries ``"version": 1``, the request's ``"id"`` and
either ``"ok": true, "result": {...}`` or ``"ok": false, "error": {code,
message, hint, details}``. A malformed, oversized or unknown message gets an
error reply and the connection is closed. The schema is documented in
``docs/api.md`` and is stable within a version: fields may be added to
replies, never removed or changed in meaning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypedDict, get_args

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
)

from migd.core.leases import LeaseView
from migd.core.mps import job_cgroup_problem
from migd.errors import MigdError, ProtocolError
from migd.protocol import API_VERSION, MAX_NESTING, decode, encode

JOB_ID = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
#: SQLite's largest INTEGER: ids and counts compared with stored rows stay below it.
SQLITE_MAX = 2**63 - 1
#: Process ids: the kernel's pid_max is at most 2^22; anything past an int32 is no pid.
PID = Annotated[int, Field(gt=0, le=2**31 - 1)]
LEASE_ID = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
GPU_REF = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]


def _job_cgroup(path: str | None) -> str | None:
    problem = None if path is None else job_cgroup_problem(path)
    if problem is not None:
        raise ValueError(problem)
    return path


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    version: Literal[1]
    id: int | str | None = None


class PingRequest(_Request):
    op: Literal["ping"]


class LeaseRequestMsg(_Request):
    """Ask for a partition. The reply comes when the lease is active, or on refusal/expiry."""

    op: Literal["lease"]
    job_id: JOB_ID
    slot: Annotated[str, Field(max_length=256)] = ""
    # The lease's GPU memory: ``memory_mib`` from migd-run's --gpu-memory to the NVML
    # create. On the wire it is ``gpu_memory_mib``, the name every daemon so far takes
    # (wrappers send it, so a wrapper upgraded before its daemon still works); this
    # daemon takes ``memory_mib`` as well.
    memory_mib: Annotated[
        int,
        Field(ge=0, le=100_000_000, validation_alias=AliasChoices("gpu_memory_mib", "memory_mib")),
    ]
    min_compute: Annotated[int, Field(ge=0, le=64)] = 0
    profile: Annotated[str | None, Field(max_length=64)] = None
    mode: Literal["mig", "mps", "auto"] = "auto"
    gpus: Annotated[list[GPU_REF] | None, Field(max_length=64)] = None
    # Several GPUs for one job (docs/api.md, "Several GPUs per job"): gpu_count leases,
    # one per GPU, granted all or none, each of gpu_memory_mib. With ``gpus`` of exactly
    # gpu_count entries, member i goes on gpus[i] (a GPU may repeat: HTCondor assigned
    # two of its shares). Absent (older wrappers): 1, the single lease as ever.
    gpu_count: Annotated[int, Field(ge=1, le=64)] = 1
    wait_s: Annotated[float | None, Field(ge=0)] = None  # None: the daemon's default
    holder_pid: PID | None = None
    # MPS shares: CUDA client processes the job runs (each gets the pinned limit), and a
    # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (default: from min_compute, else none).
    mps_clients: Annotated[int, Field(ge=1, le=128)] = 1
    mps_thread_percentage: Annotated[int | None, Field(ge=1, le=100)] = None
    # The job's cgroup v2 path as /proc/self/cgroup prints it ("/htcondor/condor_…"):
    # an MPS share's memory is also set as that cgroup's limit where the driver can
    # (docs/mps.md, "MPS v3"). Optional: older wrappers send none.
    cgroup: Annotated[str | None, AfterValidator(_job_cgroup)] = None


class LeaseRef(_Request):
    op: Literal["release", "heartbeat", "get_lease", "usage"]
    lease_id: LEASE_ID
    reason: Annotated[str, Field(max_length=1024)] = ""


class ReleaseJobRequest(_Request):
    op: Literal["release_job"]
    job_id: JOB_ID
    reason: Annotated[str, Field(max_length=1024)] = ""
    slot: Annotated[str, Field(max_length=256)] = ""  # only leases of this slot, if given


class ReportRequest(_Request):
    """The wrapper tells migd what happened (OOM verdicts, forecasts, restarts)."""

    op: Literal["report"]
    lease_id: LEASE_ID
    # mps_client_error: data {"message": "<the job's stderr line>"}, e.g. "all
    # CUDA-capable devices are busy or unavailable"; migd passes it to the MPS manager.
    event: Literal["oom", "exit", "forecast", "restart", "note", "mps_client_error"]
    data: dict[str, Any] = Field(default_factory=dict)


class StatusRequest(_Request):
    op: Literal["status", "leases"]
    all: bool = False


class ReloadRequest(_Request):
    """Re-read the configuration (as SIGHUP). ``allow_removals``: apply it even if it
    takes rights or GPUs away without naming them (docs/configuration.md, Reload)."""

    op: Literal["reload"]
    allow_removals: bool = False


class ExplainRequest(_Request):
    op: Literal["explain"]
    job_id: JOB_ID


class HistoryRequest(_Request):
    op: Literal["history"]
    job_id: JOB_ID | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] = 50
    # Paging: rows older than this id (the reply's next_before_id); a page also stops at
    # api.max_reply_bytes, so a reply's size is bounded however large the rows are.
    before_id: Annotated[int | None, Field(ge=1, le=SQLITE_MAX)] = None


class GpuRequest(_Request):
    op: Literal["drain", "resume", "reset"]
    gpu: GPU_REF


class SimRequest(_Request):
    """Simulated backend only: a fake CUDA job attaches to and allocates on its device."""

    op: Literal["sim_attach", "sim_alloc", "sim_free", "sim_detach"]
    device_uuid: GPU_REF | None = None
    pid: PID
    mib: Annotated[int, Field(ge=0, le=100_000_000)] = 0
    mps_limit_mib: Annotated[int | None, Field(gt=0)] = None


class SimXidRequest(_Request):
    """Simulated backend only: an NVML XID critical error on a GPU (or one of its GPU
    instances), as the driver would report it (docs/operations.md, GPU health)."""

    op: Literal["sim_xid"]
    gpu: Annotated[int, Field(ge=0, le=1023)]
    xid: Annotated[int, Field(ge=1, le=65535)]
    gi_id: Annotated[int | None, Field(ge=0, le=1023)] = None
    ci_id: Annotated[int | None, Field(ge=0, le=1023)] = None


Request = Annotated[
    PingRequest
    | LeaseRequestMsg
    | LeaseRef
    | ReleaseJobRequest
    | ReportRequest
    | StatusRequest
    | ReloadRequest
    | ExplainRequest
    | HistoryRequest
    | GpuRequest
    | SimRequest
    | SimXidRequest,
    Field(discriminator="op"),
]
_REQUEST = TypeAdapter(Request)
#: Every op, in the order the request types declare them: read from their ``op`` fields,
#: so a new request type is a new op with nothing else to list.
OPS = [
    op
    for model in get_args(get_args(Request)[0])
    for op in get_args(model.model_fields["op"].annotation)
]


def _nesting(value: Any) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (a scalar is 0)."""
    depth = 0
    level: list[Any] = [value]
    while level:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [child for c in containers for child in (c.values() if isinstance(c, dict) else c)]
    return depth


def decode_request(line: bytes) -> Request:
    """Parse one request line.

    Raises:
        ProtocolError: not JSON, nested deeper than ``MAX_NESTING``, not an object,
            wrong version, unknown op, bad fields.
    """
    try:
        raw = decode(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not a JSON message: {exc}") from exc
    except RecursionError as exc:  # the C parser recurses once per nesting level
        raise ProtocolError(f"message nested deeper than {MAX_NESTING} levels") from exc
    # Counting brackets is a fast upper bound; only messages with many pay the exact walk.
    if line.count(b"[") + line.count(b"{") > MAX_NESTING and _nesting(raw) > MAX_NESTING:
        raise ProtocolError(f"message nested deeper than {MAX_NESTING} levels")
    if not isinstance(raw, dict):
        raise ProtocolError("a message must be a JSON object")
    version = raw.get("version")
    if type(version) is not int or version != API_VERSION:  # neither true nor 1.0
        raise ProtocolError(
            f"unsupported API version {version!r}; this daemon speaks {API_VERSION}",
            hint="upgrade the client (migctl/migd-wrapper) to match the daemon",
        )
    op = raw.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown op {op!r}", hint=f"known ops: {', '.join(OPS)}")
    try:
        return _REQUEST.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'message'}: {e['msg']}"
            for e in exc.errors()
        )
        raise ProtocolError(f"invalid {op} request: {problems}") from exc


def ok_reply(request_id: int | str | None, result: Any) -> bytes:
    return encode({"version": API_VERSION, "id": request_id, "ok": True, "result": result})


def error_reply(request_id: int | str | None, error: MigdError) -> bytes:
    return encode({"version": API_VERSION, "id": request_id, "ok": False, "error": error.to_dict()})


# -- replies ----------------------------------------------------------------------------------
# The typed shapes of the main replies (the lease-ended event is
# migd.core.lease_end.LeaseEnded, a lease view migd.core.leases.LeaseView).


class LeaseReply(LeaseView):
    """The ``lease`` op's reply: the active lease, and how it got there."""

    queued: bool  # it waited in the queue for capacity
    prepared: bool  # NVML made its partition for it (NVML time, not queueing)


class GroupLeaseReply(LeaseReply):
    """The ``lease`` op's reply for a job on several GPUs (``gpu_count`` > 1): the first
    member's view, ``env`` listing every device, and every member's view in order
    (docs/api.md, "Several GPUs per job")."""

    group: list[LeaseView]


class StatusReply(TypedDict):
    """The ``status`` op's reply (``migctl status``, the machine ad's numbers);
    ``schema`` is its version (docs/api.md)."""

    schema: int
    node: str
    daemon: dict[str, Any]  # version, pid, uptime, backend, socket, latency, policy
    gpus: list[dict[str, Any]]  # per GPU: identity, mode, health, its mode's view
    queue: list[dict[str, Any]]  # the head of the queue
    queue_summary: dict[str, Any]  # length, shown, memory_mib, oldest_waiting_s
    leases: dict[str, int]  # queued / preparing / active -> count
    state_disk: dict[str, Any]  # ok, reason, since_s
    startd: dict[str, Any]  # whether the startd's configuration bypasses migd (docs/api.md)
    notes: list[str]
