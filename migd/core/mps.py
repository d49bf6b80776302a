"""MPS accounting and policy: who may share an MPS device, and how much of it.

Pure: no processes, files or NVML. :mod:`migd.backends.mps` runs the control
daemons; this module decides whether a share fits and what environment its
job gets.

An *MPS device* is what one MPS control daemon serves in migd: a whole GPU in
MPS mode, or one MIG instance with MPS on top (the MIG user guide runs one
daemon per MIG device, each with its own pipe directory). Each device has an
:class:`MpsPool`:

* **Memory.** ``capacity = device memory - reserve``. Every share carries a
  per-client pinned-memory limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and a
  number of CUDA client processes it may run; it is accounted as
  ``limit × clients``, and the sum over active shares never exceeds the
  capacity. MPS enforces the limit *per client process*, not per job
  (NVIDIA/k8s-device-plugin#594, #720): a job that starts more CUDA processes
  than it declared can use more than it was accounted for, which only NVML
  monitoring can catch.
* **Clients.** An MPS server takes a bounded number of client CUDA contexts per
  device: 48 on Volta and later in the classic MPS guide (16 before Volta;
  heterodb/pg-strom#304 quotes both), reportedly 60 in current NVIDIA docs for
  newer drivers (a secondary quote, not verified here), and fewer on a MIG
  device, in proportion to its compute instance (MIG user guide, quoted
  secondarily). Context creation beyond the cap fails in the client. Operators
  have also reported ``all CUDA-capable devices are busy or unavailable`` well
  below 48 clients on small GPUs (NVIDIA/k8s-device-plugin#1118: T4 at 21, A30
  at 30), which is why :attr:`MpsPool.max_clients` is configurable.
* **Users.** One MPS server serves one Linux UID. A client of another UID waits
  until the running server's clients are done (``nvidia-cuda-mps-control(1)``:
  "the control daemon requests the existing server to shutdown as soon as all
  its clients are done"). :attr:`UserPolicy.PER_USER` makes that explicit
  instead of leaving jobs hanging in CUDA init: shares of different UIDs on one
  device are serialised, and a waiting UID can drain the device so that it is
  not starved. :attr:`UserPolicy.MULTI_USER` corresponds to a daemon started
  with ``-M``: "clients from all Linux users will appear as clients from the
  root user and connect to the root MPS server. It is important to make sure
  that isolation between different users (including the root user) can be
  safely disregarded before enabling this mode" (NVIDIA MPS docs as quoted in
  kubernetes-sigs/dra-driver-nvidia-gpu#1153). ``-M`` needs Volta or later.

The types are plain dataclasses (``to_dict``/``from_dict``) so the daemon can
persist pools in its state store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from migd.errors import InvalidRequest, NoCapacity, RequestTooLarge

#: Client CUDA contexts per device for Volta and later in the classic MPS guide.
MPS_MAX_CLIENTS_VOLTA = 48
#: Reported for newer drivers (CUDA 13.x docs, secondary source): opt-in only.
MPS_MAX_CLIENTS_NEWER = 60
#: Device index in ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``: migd starts one control
#: daemon per device with ``CUDA_VISIBLE_DEVICES=<uuid>``, so every client sees
#: exactly one device and it is device 0 (devices are remapped by the server,
#: docs.nvidia.com/deploy/mps/latest/appendix-environment-variables.html).
MPS_CLIENT_DEVICE_INDEX = 0

# What MPS costs in device memory, measured on an NVIDIA H200 (driver 580.159.04, CUDA 13.0,
# PyTorch 2.11 clients; tests/data/mps_gpu_check/20261126T015109Z-h200/):
#: The MPS server's own memory: NVML listed it at 66 MiB (probe_during_mps.json, pid 595;
#: PyTorch's OOM messages say "Process 595 has 66.00 MiB memory in use").
MPS_SERVER_MIB = 66
#: A client's CUDA context, which counts inside its pinned limit: with ``0=1024M``
#: cudaMemGetInfo said 510 MiB free before any allocation (clients.jsonl, over_env_limit,
#: same_job_a/b), so 514 MiB of the limit is the context at 100 % of the threads...
MPS_CLIENT_CONTEXT_MIB = 514
#: ...and 271 MiB at 50 % (the held client: 753 MiB free of 1024, NVML 530 MiB used with
#: 256 MiB allocated). The per-thread stacks scale with the SMs a client may use.
MPS_CLIENT_CONTEXT_MIB_AT_HALF = 271


def client_context_mib(thread_percentage: int | None = None) -> int:
    """Device memory a client's CUDA context takes out of its pinned limit.

    A line through the two recorded points (514 MiB at 100 %, 271 MiB at 50 %): a fixed
    part plus one in proportion to the active thread percentage. Between and below the
    points it is inferred, and it was measured on one GPU model and one PyTorch: other
    models (SM counts) and frameworks differ (docs/mps.md).
    """
    pct = 100 if thread_percentage is None else max(1, min(100, thread_percentage))
    per_pct = (MPS_CLIENT_CONTEXT_MIB - MPS_CLIENT_CONTEXT_MIB_AT_HALF) / 50
    fixed = MPS_CLIENT_CONTEXT_MIB - 100 * per_pct
    return round(fixed + per_pct * pct)


class UserPolicy(StrEnum):
    """How shares of different Linux users may use one MPS device."""

    PER_USER = "per-user"  # one UID at a time; others wait (default, keeps UID isolation)
    MULTI_USER = "multi-user"  # daemon started with -M: any UIDs share one root server


class DeviceKind(StrEnum):
    GPU = "gpu"  # a whole GPU in MPS mode
    MIG = "mig"  # one MIG device (GPU instance + compute instance) with MPS on top


@dataclass(frozen=True, slots=True)
class MpsRequest:
    """What a job asks of an MPS device.

    Attributes:
        share_id: the lease's identity; unique per device.
        uid: the job's Linux UID (the MPS server must run as it in per-user mode).
        memory_mib: pinned device-memory limit *per CUDA client process*.
        clients: how many CUDA client processes the job may run (each gets the limit).
        thread_percentage: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (1-100) when the job
            asks for a compute share; ``None`` for no limit.
        gid: the job's primary GID (used to start a per-user daemon as that user).
    """

    share_id: str
    uid: int
    memory_mib: int
    clients: int = 1
    thread_percentage: int | None = None
    gid: int | None = None

    def __post_init__(self) -> None:
        if not self.share_id:
            raise InvalidRequest("an MPS share needs a share id")
        if self.uid < 0:
            raise InvalidRequest(f"uid must not be negative: {self.uid}")
        if self.memory_mib <= 0:
            raise InvalidRequest(
                f"MPS pinned-memory limit must be positive, got {self.memory_mib} MiB",
                hint="ask for GPU memory, e.g. request_VRAM = 4096",
            )
        if self.clients < 1:
            raise InvalidRequest(f"an MPS share needs at least one client, got {self.clients}")
        if self.thread_percentage is not None and not 1 <= self.thread_percentage <= 100:
            raise InvalidRequest(
                f"active thread percentage must be 1-100, got {self.thread_percentage}"
            )

    @property
    def accounted_mib(self) -> int:
        """Memory this share takes from the pool: the limit for each client process."""
        return self.memory_mib * self.clients


# An admitted share is the request as granted; the same fields, kept as its own name so
# the daemon's records read naturally.
MpsShare = MpsRequest


@dataclass(frozen=True, slots=True)
class Admission:
    """Answer of :func:`can_admit`: ``ok``, or why not (for the daemon's queue and logs)."""

    ok: bool
    reason: str = ""
    waiting_for_uid: int | None = None  # per-user: the UID whose turn comes first

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class MpsPool:
    """Accounting for one MPS device. Immutable: :func:`admit`/:func:`release` return new pools.

    Attributes:
        device_uuid: ``GPU-...`` or ``MIG-...`` UUID the control daemon is bound to.
        memory_total_mib: device memory (``nvidia-smi --query-gpu=memory.total``, or the
            MIG device's memory).
        reserve_mib: kept back for the MPS server's own context and per-client overhead.
        max_clients: client processes the device takes (see :func:`max_clients_for`).
        policy: per-user or multi-user.
        shares: active shares, in admission order.
        draining_for_uid: per-user only: a UID that waits for this device; while set, no
            new share of the current UID is admitted, so the device drains and the
            waiting UID is not starved.
    """

    device_uuid: str
    memory_total_mib: int
    reserve_mib: int = 0
    max_clients: int = MPS_MAX_CLIENTS_VOLTA
    policy: UserPolicy = UserPolicy.PER_USER
    kind: DeviceKind = DeviceKind.GPU
    shares: tuple[MpsShare, ...] = ()
    draining_for_uid: int | None = None
    #: The client cap as seen: clients connected when the device refused one
    #: (:func:`observe_client_cap`); ``max_clients`` is at most this once set.
    clients_cap_seen: int | None = None

    def __post_init__(self) -> None:
        if self.memory_total_mib < 0 or self.reserve_mib < 0:
            raise InvalidRequest("device memory and reserve must not be negative")
        if self.max_clients < 1:
            raise InvalidRequest(f"max_clients must be at least 1, got {self.max_clients}")

    @property
    def capacity_mib(self) -> int:
        """What shares may pin in total: device memory minus the reserve."""
        return max(0, self.memory_total_mib - self.reserve_mib)

    @property
    def used_mib(self) -> int:
        return sum(s.accounted_mib for s in self.shares)

    @property
    def free_mib(self) -> int:
        return max(0, self.capacity_mib - self.used_mib)

    @property
    def clients(self) -> int:
        return sum(s.clients for s in self.shares)

    @property
    def owner_uid(self) -> int | None:
        """Per-user: the UID the device serves now (``None`` when idle or multi-user)."""
        if self.policy is UserPolicy.MULTI_USER or not self.shares:
            return None
        return self.shares[0].uid

    def share(self, share_id: str) -> MpsShare | None:
        return next((s for s in self.shares if s.share_id == share_id), None)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the daemon's state store."""
        return {
            "device_uuid": self.device_uuid,
            "memory_total_mib": self.memory_total_mib,
            "reserve_mib": self.reserve_mib,
            "max_clients": self.max_clients,
            "policy": self.policy.value,
            "kind": self.kind.value,
            "draining_for_uid": self.draining_for_uid,
            "clients_cap_seen": self.clients_cap_seen,
            "shares": [
                {
                    "share_id": s.share_id,
                    "uid": s.uid,
                    "gid": s.gid,
                    "memory_mib": s.memory_mib,
                    "clients": s.clients,
                    "thread_percentage": s.thread_percentage,
                }
                for s in self.shares
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MpsPool:
        """Inverse of :meth:`to_dict`.

        Raises:
            InvalidRequest: a field is missing or out of range.
        """
        try:
            shares = tuple(
                MpsShare(
                    share_id=str(s["share_id"]),
                    uid=int(s["uid"]),
                    gid=None if s.get("gid") is None else int(s["gid"]),
                    memory_mib=int(s["memory_mib"]),
                    clients=int(s.get("clients", 1)),
                    thread_percentage=(
                        None if s.get("thread_percentage") is None else int(s["thread_percentage"])
                    ),
                )
                for s in data.get("shares", ())
            )
            draining = data.get("draining_for_uid")
            seen = data.get("clients_cap_seen")
            return cls(
                device_uuid=str(data["device_uuid"]),
                memory_total_mib=int(data["memory_total_mib"]),
                reserve_mib=int(data.get("reserve_mib", 0)),
                max_clients=int(data.get("max_clients", MPS_MAX_CLIENTS_VOLTA)),
                policy=UserPolicy(data.get("policy", UserPolicy.PER_USER.value)),
                kind=DeviceKind(data.get("kind", DeviceKind.GPU.value)),
                shares=shares,
                draining_for_uid=None if draining is None else int(draining),
                clients_cap_seen=None if seen is None else int(seen),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"unreadable MPS pool record: {exc}") from exc


def max_clients_for(
    base: int = MPS_MAX_CLIENTS_VOLTA,
    *,
    compute_slices: int | None = None,
    total_compute_slices: int | None = None,
) -> int:
    """Client cap of a device: ``base`` for a whole GPU, proportionally fewer on MIG.

    Under MIG the MPS client limit is lowered in proportion to the compute instance
    (MIG user guide, "MIG with CUDA MPS", as quoted secondarily); e.g. a 3g instance
    of a 7-slice A100 gets ``48 * 3 // 7 = 20``. Never below 1.

    Raises:
        InvalidRequest: slices out of range.
    """
    if base < 1:
        raise InvalidRequest(f"client cap must be at least 1, got {base}")
    if compute_slices is None or total_compute_slices is None:
        return base
    if not 0 < compute_slices <= total_compute_slices:
        raise InvalidRequest(
            f"compute slices {compute_slices} out of range 1..{total_compute_slices}"
        )
    return max(1, base * compute_slices // total_compute_slices)


def can_admit(pool: MpsPool, request: MpsRequest) -> Admission:
    """Whether ``request`` fits on ``pool`` now.

    Order of checks: duplicate id, never-fits (raises), user policy, clients, memory.

    Raises:
        RequestTooLarge: the request can never fit on this device, even idle (limit ×
            clients above the capacity, or more clients than the device takes).
    """
    if pool.share(request.share_id) is not None:
        return Admission(False, f"share {request.share_id} is already active on this device")
    _check_ever_fits(pool, request)
    if pool.policy is UserPolicy.PER_USER:
        owner = pool.owner_uid
        if owner is not None and owner != request.uid:
            n = sum(1 for s in pool.shares if s.uid == owner)
            return Admission(
                False,
                f"MPS device {pool.device_uuid} serves uid {owner} ({n} share(s)); one MPS "
                f"server serves one user, so uid {request.uid} waits until they end",
                waiting_for_uid=owner,
            )
        if (
            owner is not None
            and pool.draining_for_uid is not None
            and pool.draining_for_uid != request.uid
        ):
            return Admission(
                False,
                f"MPS device {pool.device_uuid} is draining for uid {pool.draining_for_uid}, "
                "which queued first",
                waiting_for_uid=pool.draining_for_uid,
            )
        if owner is None and pool.draining_for_uid not in (None, request.uid):
            return Admission(
                False,
                f"MPS device {pool.device_uuid} is reserved for uid {pool.draining_for_uid}, "
                "which queued first",
                waiting_for_uid=pool.draining_for_uid,
            )
    if pool.clients + request.clients > pool.max_clients:
        return Admission(
            False,
            f"MPS device {pool.device_uuid} has {pool.clients} of {pool.max_clients} client "
            f"processes in use; {request.clients} more do not fit now",
        )
    if request.accounted_mib > pool.free_mib:
        return Admission(
            False,
            f"MPS device {pool.device_uuid} has {pool.free_mib} MiB of {pool.capacity_mib} MiB "
            f"unpinned; {request.accounted_mib} MiB do not fit now",
        )
    return Admission(True)


def _check_ever_fits(pool: MpsPool, request: MpsRequest) -> None:
    if request.accounted_mib > pool.capacity_mib:
        per = ""
        if request.clients > 1:
            per = f" ({request.clients} clients × {request.memory_mib} MiB)"
        raise RequestTooLarge(
            f"{request.accounted_mib} MiB{per} is more than MPS device {pool.device_uuid} can "
            f"ever give ({pool.capacity_mib} MiB = {pool.memory_total_mib} MiB minus a "
            f"{pool.reserve_mib} MiB reserve)",
            requested_mib=request.accounted_mib,
            capacity_mib=pool.capacity_mib,
            device_uuid=pool.device_uuid,
        )
    if request.clients > pool.max_clients:
        raise RequestTooLarge(
            f"{request.clients} CUDA client processes are more than MPS device "
            f"{pool.device_uuid} takes ({pool.max_clients})",
            hint="run fewer CUDA processes per job, or ask for a MIG partition or a whole GPU",
            requested_clients=request.clients,
            max_clients=pool.max_clients,
        )


def admit(pool: MpsPool, request: MpsRequest) -> MpsPool:
    """The pool with ``request`` added as an active share.

    A waiting UID's drain mark is cleared once that UID gets the device.

    Raises:
        RequestTooLarge: it can never fit (see :func:`can_admit`).
        NoCapacity: it cannot fit now; ``details["reason"]`` says why (the daemon queues).
    """
    answer = can_admit(pool, request)
    if not answer.ok:
        raise NoCapacity(
            answer.reason,
            reason=answer.reason,
            device_uuid=pool.device_uuid,
            waiting_for_uid=answer.waiting_for_uid,
        )
    draining = None if pool.draining_for_uid == request.uid else pool.draining_for_uid
    return replace(pool, shares=(*pool.shares, request), draining_for_uid=draining)


def release(pool: MpsPool, share_id: str) -> MpsPool:
    """The pool without share ``share_id``; releasing an unknown share is a no-op.

    Idempotent on purpose: the wrapper and the HTCondor job-exit hook may both release.
    """
    if pool.share(share_id) is None:
        return pool
    return replace(pool, shares=tuple(s for s in pool.shares if s.share_id != share_id))


def mark_waiting(pool: MpsPool, uid: int) -> MpsPool:
    """Per-user: let ``uid`` drain the device (no new shares of the current owner).

    Call it when a request of ``uid`` was refused for the user policy and queued. The
    first waiting UID keeps the mark; a no-op in multi-user mode or for the owner.
    """
    if pool.policy is UserPolicy.MULTI_USER or pool.draining_for_uid is not None:
        return pool
    if pool.owner_uid in (None, uid):
        return pool
    return replace(pool, draining_for_uid=uid)


def clear_waiting(pool: MpsPool) -> MpsPool:
    """Drop the drain mark (the waiting request was cancelled or timed out)."""
    return replace(pool, draining_for_uid=None)


def observe_client_cap(pool: MpsPool, clients_at_refusal: int) -> MpsPool:
    """The pool with its client capacity lowered to the cap the device showed.

    ``clients_at_refusal`` is how many clients were connected when the device refused one
    (``all CUDA-capable devices are busy or unavailable`` with clients running; the MPS
    manager counts them, ``migctl status`` shows ``clients_at_refusal``). The device took
    that many and no more, whatever the configured or documented cap (48, fewer on small
    MIG devices, lower still on some GPUs: NVIDIA/k8s-device-plugin#1118), so the books
    take no more either: the next share that would pass it waits or goes to another
    device instead of being refused by the daemon. Clients that had left between the
    refusal and the count make the figure low, never high, so it errs on the side of
    waiting. Only ever lowers; shares already admitted stay (they were running).
    """
    cap = max(1, clients_at_refusal)
    seen = cap if pool.clients_cap_seen is None else min(cap, pool.clients_cap_seen)
    if seen == pool.clients_cap_seen and pool.max_clients <= seen:
        return pool
    return replace(pool, max_clients=min(pool.max_clients, seen), clients_cap_seen=seen)


def format_limit_mib(memory_mib: int) -> str:
    """``4096`` -> ``"4096M"``: the ``<int>M`` value form of MPS limits.

    ``set_default_device_pinned_mem_limit`` takes an integer with ``G`` or ``M``
    (MPS v2 interface docs); MiB keeps every limit exact.
    """
    if memory_mib <= 0:
        raise InvalidRequest(f"MPS memory limit must be positive, got {memory_mib}")
    return f"{memory_mib}M"


def parse_limit_mib(text: str) -> int | None:
    """Parse a limit as ``get_*_pinned_mem_limit`` prints it (``"3G"``, ``"4096M"``).

    Returns ``None`` for anything else (no limit set, or a format this code does not
    know). Newer drivers have been seen to print limits of 1 GiB and more as whole
    ``G``, rounded down; callers must not compare with what they set literally.
    """
    value = text.strip()
    if not value:
        return None
    number, unit = value[:-1], value[-1:].upper()
    if value.upper().endswith("MB"):
        number, unit = value[:-2], "M"
    elif value.upper().endswith("GB"):
        number, unit = value[:-2], "G"
    try:
        amount = float(number)
    except ValueError:
        return None
    if unit == "M":
        return int(amount)
    if unit == "G":
        return int(amount * 1024)
    return None


def readable_limit_mib(memory_mib: int) -> int:
    """The limit migd sets on an MPS daemon or server for a share of ``memory_mib``.

    Drivers print limits of 1 GiB and more as whole, rounded-down ``G`` (an H200,
    driver 580.159.04, showed 1536M as ``1G``: tests/data/mps_gpu_check/), so a read-back
    of ``1G`` cannot tell a 1536M limit that took effect from an old 1024M one that
    stayed. The daemon's bound is therefore set to a value that reads back exactly: as
    is below 1 GiB, rounded *up* to whole GiB from 1 GiB on. The job's own
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` stays exact (``0=<N>M``), and only lowers the
    server's; the rounding only lets a job that drops its variable reach up to 1023 MiB
    past the largest share (docs/mps.md).
    """
    if memory_mib <= 0:
        raise InvalidRequest(f"MPS memory limit must be positive, got {memory_mib}")
    if memory_mib < 1024:
        return memory_mib
    return -(-memory_mib // 1024) * 1024


def limit_applied(read_back: str, target_mib: int) -> bool:
    """Whether a limit read back with ``get_*_pinned_mem_limit`` is ``target_mib``, exactly.

    Exact on purpose: a target the driver cannot show exactly (1 GiB or more, not whole
    GiB) is never confirmed, since ``1G`` is what 1024 to 2047 MiB all read back as. migd
    sets only :func:`readable_limit_mib` values, which read back exactly (``"1536M"`` from
    an older driver still matches 1536).
    """
    read = parse_limit_mib(read_back)
    return read is not None and read == target_mib


def parse_pinned_limit_env(value: str, device_uuid: str | None = None) -> int | None:
    """The limit for the client's device 0 in a ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` value.

    The value is a comma list of ``<device>=<limit>`` where a device is an ordinal or a
    UUID, "the same semantics as ``CUDA_VISIBLE_DEVICES``", e.g. ``0=1G,1=512MB``
    (docs.nvidia.com/deploy/mps/appendix-environment-variables.html). Every client of a
    migd daemon sees one device, ordinal 0, which is ``device_uuid`` (a UUID prefix
    counts, as in ``CUDA_VISIBLE_DEVICES``). Returns ``None`` when no entry names it or
    its size cannot be read.
    """
    for part in value.split(","):
        device, sep, size = part.partition("=")
        device = device.strip()
        if not sep or not device:
            continue
        if device == str(MPS_CLIENT_DEVICE_INDEX) or (
            device_uuid is not None
            and device.startswith(("GPU-", "MIG-"))
            and device_uuid.startswith(device)
        ):
            return parse_limit_mib(size)
    return None


def pinned_limit_env_value(memory_mib: int) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for one visible device: ``"0=<MiB>M"``.

    The variable is a comma list of ``<device>=<limit>`` (``0=2G``, ``0=4096M,1=512M``;
    docs.nvidia.com/deploy/mps appendix "Environment Variables"; the
    ``"%dMB"`` -> ``"0=%dM"`` fix in GoogleCloudPlatform/container-engine-accelerators#308).
    """
    return f"{MPS_CLIENT_DEVICE_INDEX}={format_limit_mib(memory_mib)}"


def client_environment(
    device_uuid: str,
    memory_mib: int,
    thread_percentage: int | None = None,
    *,
    pipe_dir: str | None = None,
    log_dir: str | None = None,
) -> dict[str, str]:
    """The environment a job needs to run as a client of its device's MPS daemon: the one
    place it is built (the scheduler's grant, the daemon and the MPS manager use it).

    * ``CUDA_VISIBLE_DEVICES=<uuid>`` (and ``NVIDIA_VISIBLE_DEVICES`` for containers): the
      daemon sees only this device and remaps it to 0; NVIDIA recommends UUIDs over
      indices for exactly this case (appendix "Environment Variables"), and HTCondor's
      starter would otherwise leave its own index-based value in place.
    * ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`` (:func:`pinned_limit_env_value`): per
      client process (CUDA >= 11.5).
    * ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``: only for a compute share; it can only lower
      the daemon's setting (topic_5_2_5).
    * ``CUDA_MPS_PIPE_DIRECTORY`` when known: it must equal the daemon's ("should be
      consistent across all MPS clients sharing the same MPS server, and the MPS control
      daemon", docs.nvidia.com/deploy/topics/topic_5_2_2.html). A client that cannot
      reach a daemon silently runs *without* MPS, i.e. without a memory limit
      (``nvidia-cuda-mps-control(1)``), so the wrapper must pass it through unchanged.
    * ``CUDA_MPS_LOG_DIRECTORY`` when known: NVIDIA's client recipe sets it to the
      daemon's too (topic_6_1_2_2).
    """
    env = {
        "CUDA_VISIBLE_DEVICES": device_uuid,
        "NVIDIA_VISIBLE_DEVICES": device_uuid,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": pinned_limit_env_value(memory_mib),
    }
    if pipe_dir is not None:
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_dir
    if log_dir is not None:
        env["CUDA_MPS_LOG_DIRECTORY"] = log_dir
    if thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    return env


def share_environment(
    share: MpsShare,
    pipe_dir: str,
    device_uuid: str,
    log_dir: str | None = None,
) -> dict[str, str]:
    """:func:`client_environment` of an admitted share on its daemon's pipe directory."""
    return client_environment(
        device_uuid,
        share.memory_mib,
        share.thread_percentage,
        pipe_dir=pipe_dir,
        log_dir=log_dir,
    )


#: The first driver branch with MPS v3 memory partitioning (CUDA 13.4): per-cgroup
#: device-memory limits through ``nvmlDeviceSetMemoryLimits_v1``
#: (docs.nvidia.com/deploy/mps/latest/mpsv3-memory-partitioning.html).
MPS_V3_MIN_DRIVER_MAJOR = 615
#: The NVML entry point that sets them (docs.nvidia.com/deploy/nvml-api/api/
#: structnvmlSetMemoryLimits__v1__t.html).
MPS_V3_NVML_SYMBOL = "nvmlDeviceSetMemoryLimits_v1"


def mps_v3_unsupported(
    driver_version: str, *, has_symbol: bool, mig_enabled: bool, cgroup_v2: bool
) -> str | None:
    """Why per-cgroup memory limits cannot be used on a GPU, or ``None`` if they can.

    NVIDIA's requirements: driver r615 / CUDA 13.4 or later, cgroup v2, "a non-MIG
    device" (mpsv3-memory-partitioning), and NVML's ``nvmlDeviceSetMemoryLimits_v1``
    ("MIG handles are not supported"). Both the driver version and the symbol are
    checked: a library can be newer or older than the kernel driver it talks to.
    """
    try:
        major = int(driver_version.split(".", 1)[0])
    except ValueError:
        return f"driver version {driver_version!r} cannot be read"
    if major < MPS_V3_MIN_DRIVER_MAJOR:
        return (
            f"driver {driver_version} is older than r{MPS_V3_MIN_DRIVER_MAJOR} "
            "(MPS v3 memory partitioning needs r615 / CUDA 13.4)"
        )
    if not has_symbol:
        return f"the NVML library has no {MPS_V3_NVML_SYMBOL}"
    if mig_enabled:
        return "MIG is enabled: per-cgroup memory limits need a non-MIG device"
    if not cgroup_v2:
        return "the host does not use cgroup v2 (unified hierarchy)"
    return None


#: How long a GPU's MPS v3 detection holds before it is asked again (MIG mode can change
#: under migd's own hand; a driver update needs a reload of the module, i.e. no jobs).
MPS_V3_RECHECK_S = 300.0
#: The longest job cgroup path a lease may name (PATH_MAX).
CGROUP_PATH_MAX = 4096


def job_cgroup_problem(path: str) -> str | None:
    """Why ``path`` is not a job cgroup a lease may name, or ``None`` if it is.

    The wrapper sends its own cgroup v2 path as ``/proc/self/cgroup`` prints it (``0::/…``):
    absolute in the cgroup hierarchy, which the daemon joins to its cgroup root. A ``..``
    or ``.`` component, an empty one, or a control character could make that join name
    something else, so none is taken.
    """
    if not path.startswith("/"):
        return f"cgroup path {path!r} is not absolute (as /proc/self/cgroup prints it)"
    if len(path) > CGROUP_PATH_MAX:
        return f"cgroup path is longer than {CGROUP_PATH_MAX} characters"
    if any(ord(c) < 0x20 or c == "\x7f" for c in path):
        return "cgroup path has a control character"
    if path.rstrip("/") == "":
        return "the root cgroup is not a job's cgroup"
    parts = path.split("/")[1:]
    if any(p in ("", ".", "..") for p in parts):
        return f"cgroup path {path!r} has an empty, '.' or '..' component"
    return None


class CgroupLimitAction(StrEnum):
    """What :func:`cgroup_limit_decision` says to do with an MPS share's job cgroup."""

    DETECT = "detect"  # ask the port whether the GPU supports it, then decide again
    APPLY = "apply"  # set the cgroup's hard limit
    SKIP = "skip"  # keep the pinned per-process limit only; ``reason`` says why


@dataclass(frozen=True, slots=True)
class CgroupSupport:
    """A GPU's MPS v3 detection (:func:`mps_v3_unsupported` through the port) and when."""

    reason: str | None  # None: supported
    checked_s: float


@dataclass(frozen=True, slots=True)
class CgroupLimitDecision:
    action: CgroupLimitAction
    reason: str = ""


def cgroup_limit_decision(
    *,
    setting: str,
    support: CgroupSupport | None,
    now_s: float,
    cgroup: str | None,
    kind: DeviceKind,
    hard_mib: int,
    device_mib: int,
    recheck_s: float = MPS_V3_RECHECK_S,
) -> CgroupLimitDecision:
    """Whether an MPS share's memory is also set as its job cgroup's hard limit (MPS v3).

    ``setting`` is ``mps.cgroup_limits`` (``auto``: where detection allows; ``off``).
    The pinned per-process limit stays in every case: this only adds the job-wide bound.
    Order: the switch, the device kind (v3 memory partitioning is for "a non-MIG device"),
    the cgroup (an older wrapper sends none), detection (asked when unknown or older than
    ``recheck_s``), then the size (above the device there is nothing to bound).
    """
    if setting == "off":
        return CgroupLimitDecision(CgroupLimitAction.SKIP, "mps.cgroup_limits = off")
    if kind is DeviceKind.MIG:
        return CgroupLimitDecision(
            CgroupLimitAction.SKIP, "a MIG device: per-cgroup memory limits need a non-MIG device"
        )
    if cgroup is None:
        return CgroupLimitDecision(
            CgroupLimitAction.SKIP, "the lease named no job cgroup (a wrapper older than it)"
        )
    if support is None or now_s - support.checked_s >= recheck_s or now_s < support.checked_s:
        return CgroupLimitDecision(CgroupLimitAction.DETECT)
    if support.reason is not None:
        return CgroupLimitDecision(CgroupLimitAction.SKIP, support.reason)
    if hard_mib <= 0 or hard_mib > device_mib:
        return CgroupLimitDecision(
            CgroupLimitAction.SKIP,
            f"{hard_mib} MiB is not a limit within the device's {device_mib} MiB",
        )
    return CgroupLimitDecision(CgroupLimitAction.APPLY)


@dataclass(frozen=True, slots=True)
class AppliedCgroupLimit:
    """A job cgroup limit migd set for a lease (cleared at its release)."""

    gpu: int
    device_uuid: str
    cgroup: str  # the full path given to NVML
    hard_mib: int


@dataclass
class CgroupLimitBook:
    """What the daemon knows of MPS v3 limits: each GPU's detection, the limits in force
    by lease, and the last reason a device's lease got none (for ``migctl status``)."""

    support: dict[int, CgroupSupport] = field(default_factory=dict)
    applied: dict[str, AppliedCgroupLimit] = field(default_factory=dict)
    why_not: dict[str, str] = field(default_factory=dict)

    def device_status(self, device_uuid: str, *, setting: str, kind: DeviceKind) -> dict[str, Any]:
        """``{"in_force": bool, "leases": n, "why_not": str}`` of one MPS device."""
        leases = sorted(k for k, v in self.applied.items() if v.device_uuid == device_uuid)
        if leases:
            why = ""
        elif setting == "off":
            why = "mps.cgroup_limits = off"
        elif kind is DeviceKind.MIG:
            why = "a MIG device: per-cgroup memory limits need a non-MIG device"
        else:
            why = self.why_not.get(device_uuid, "no lease with a job cgroup has started on it")
        return {"in_force": bool(leases), "leases": len(leases), "why_not": why}
