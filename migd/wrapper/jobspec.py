"""What a job asks for, from its HTCondor ads or from ``migd-run`` flags (no I/O here).

Job ad attributes the wrapper reads (set in a submit file with ``+Name = value``
or by ``request_VRAM``):

================== ===================================================== ============
attribute          meaning                                               default
================== ===================================================== ============
RequestVRAM        GPU memory in MiB (``request_VRAM = 10240``)          see below
GPUsMinMemory      ``gpus_minimum_memory``: used when RequestVRAM is      none
                   absent
RequestGPUs        GPUs; 0 or absent: not a GPU job, run it as is; N > 1: 0
                   N partitions, one on each GPU HTCondor assigned,
                   each of the memory above (per GPU)
MigdMode           ``"mig"``, ``"mps"`` or ``"auto"``                     ``"auto"``
MigdMinCompute     minimum MIG compute slices                            0
MigdMaxRestarts    OOM / forecast restarts on this node                  3
MigdEarlyRestart   restart early when the forecast says it won't fit     false
MigdHorizon        total iterations (or seconds) the job will run        none
MigdGrowthFactor   on OOM ask for this × the old limit (0: next profile) 0
MigdWaitSeconds    how long to wait for a partition                      daemon's
WantIOProxy        lets the wrapper update RequestVRAM through chirp      false
KillSig            ``kill_sig``: sent first when migd takes the lease     SIGTERM
                   back (then SIGKILL after ``[wrapper] term_grace_s``)
RemoveKillSig,     further signals the starter may send (condor_rm,       none
HoldKillSig,       condor_hold, the periodic checkpoint): the wrapper
CheckpointSig      passes each on to the job (migd.wrapper.signals)
SuccessCheckpoint- ``checkpoint_exit_code``: that exit (or               none
ExitCode (-BySig-  ``...ExitSignal``) is a checkpoint, passed
-Signal)           through at once, never an out-of-memory failure
MigdCheckpointVRAM the partition (MiB) the job held at its last           none
                   checkpoint: the run after it asks for at least that
================== ===================================================== ============

Attributes the wrapper itself writes through chirp (and reads back on the next
run): ``MigdOomExit`` (this exit 86 is migd's out-of-memory exit, not the job's
own), ``MigdOomExits`` (how many there were), ``MigdLastVRAM`` (the partition the
job last ran out of, MiB), ``MigdStartFailures`` (how often in a row migd could not
start the job) and ``MigdStartFailureReason`` (why, the last time),
``MigdLeaseLost`` (this exit 85 is migd taking the job's lease back),
``MigdLeaseLosses``, ``MigdLeaseEndReason`` and ``MigdLeaseLostReason`` (how often,
why, in words); for the
user, what the job holds: ``MigdPartitionProfile``, ``MigdPartitionMB``,
``MigdPartitionMode``, ``MigdRestarts`` and ``MigdPeakMB`` (docs/operations.md).
``condor_config/20-migd-access-point.config`` decides on them.

The lease is named after the job's ``GlobalJobId`` (``schedd#cluster.proc#qdate``),
unique across access points; ``ClusterId.ProcId`` alone repeats between schedds.

The access point's transform (``condor_config/20-migd-access-point.config``)
gives every GPU job a RequestVRAM: its own, else ``gpus_minimum_memory``, else
``MIGD_DEFAULT_VRAM``. A job that reaches the wrapper with neither RequestVRAM
nor GPUsMinMemory (an access point without migd's config) is refused with a
clear reason; the slot's ``VRAM`` is never used: a reused dynamic slot carries
whatever an earlier job asked for.

From the machine (slot) ad: ``Name`` (the slot) and ``AssignedGPUs``: the lease
is restricted to the GPU behind the assigned share, because the starter hides
every other GPU's device files from the job (``STARTER_HIDE_GPU_DEVICES``,
docs/htcondor-notes.md (q)). A node that turns hiding off may set
``MigdPinToAssignedGPU = false`` in its slot ads to let migd choose the GPU.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from migd.core.condor_shares import physical_gpu
from migd.core.lease_end import signal_number
from migd.core.units import parse_mib
from migd.errors import InvalidRequest, JobAdError
from migd.wrapper.signals import STOP_ATTRS, named_signals

MODES = ("mig", "mps", "auto")


@dataclass(frozen=True)
class JobSpec:
    command: tuple[str, ...]
    job_id: str
    memory_mib: int
    slot: str = ""
    min_compute: int = 0
    mode: str = "auto"
    gpus: tuple[str, ...] | None = None
    # GPUs the job uses: one lease each, granted all or none (``request_GPUs``,
    # ``migd-run --gpus``). With more than one, ``gpus`` lists the physical GPU of each
    # assigned share in order (a GPU twice when HTCondor assigned two of its shares).
    gpu_count: int = 1
    max_restarts: int = 3
    early_restart: bool = False
    horizon: float | None = None
    growth_factor: float = 0.0
    wait_s: float | None = None
    under_condor: bool = False
    want_chirp: bool = False
    gpu_job: bool = True
    oom_exits: int = 0  # MigdOomExits: earlier out-of-memory exits (86) of this job
    oom_marker: bool = False  # MigdOomExit is still set from the last run
    start_failures: int = 0  # MigdStartFailures: runs migd could not start
    gpu_losses: int = 0  # MigdGpuLosses: runs whose GPU failed under them
    lease_losses: int = 0  # MigdLeaseLosses: runs stopped because migd took the lease back
    lease_lost_marker: bool = False  # MigdLeaseLost is still set from the last run
    # The job's soft kill signal (HTCondor's kill_sig, KillSig in the job ad): what the
    # wrapper sends first when migd takes the lease back, as HTCondor would on a vacate.
    kill_sig: int = int(signal.SIGTERM)
    # Every signal the job ad names (KillSig, RemoveKillSig, HoldKillSig, CheckpointSig):
    # passed on to the job whatever its number; the first three stop it.
    named_signals: frozenset[int] = frozenset()
    stop_signals: frozenset[int] = frozenset()
    # checkpoint_exit_code (or a checkpoint exit by signal): the job's checkpoint exit
    checkpoint_exit_code: int | None = None
    checkpoint_exit_signal: int | None = None
    checkpoint_vram: int = 0  # MigdCheckpointVRAM: the partition at the last checkpoint

    @property
    def checkpoints(self) -> bool:
        """The job checkpoints itself (HTCondor restarts it after a checkpoint exit)."""
        return self.checkpoint_exit_code is not None or self.checkpoint_exit_signal is not None


def _number(ad: Mapping[str, Any], key: str, default: float | None) -> float | None:
    value = ad.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise JobAdError(f"job ad attribute {key} = {value!r} is not a number")
    try:
        return float(value)
    except ValueError as exc:
        raise JobAdError(f"job ad attribute {key} = {value!r} is not a number") from exc


def _flag(ad: Mapping[str, Any], key: str) -> bool:
    value = ad.get(key, False)
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1")
    return bool(value)


def job_id_of(job_ad: Mapping[str, Any]) -> str:
    """The ``GlobalJobId`` (unique across access points), else ``ClusterId.ProcId``."""
    global_id = job_ad.get("GlobalJobId")
    if isinstance(global_id, str) and global_id.strip():
        return global_id.strip()
    cluster, proc = job_ad.get("ClusterId"), job_ad.get("ProcId")
    if isinstance(cluster, int) and isinstance(proc, int):
        return f"{cluster}.{proc}"
    raise JobAdError("the job ad has neither GlobalJobId nor ClusterId/ProcId")


def spec_from_ads(
    command: list[str], job_ad: Mapping[str, Any], machine_ad: Mapping[str, Any] | None
) -> JobSpec:
    """The request of a job running under HTCondor.

    Raises:
        JobAdError: a GPU job whose GPU memory cannot be read from the ads (no guess).
    """
    if not command:
        raise JobAdError("USER_JOB_WRAPPER called without a job command")
    job_id = job_id_of(job_ad)
    machine = machine_ad or {}
    gpus_requested = _number(job_ad, "RequestGPUs", 0.0) or 0.0
    vram = _number(job_ad, "RequestVRAM", None)
    if gpus_requested <= 0 and vram is None:
        return JobSpec(tuple(command), job_id, 0, under_condor=True, gpu_job=False)
    if vram is None:
        # HTCondor's own line; never the slot's VRAM (a reused dynamic slot keeps the
        # size an earlier job asked for).
        vram = _number(job_ad, "GPUsMinMemory", None)
    if vram is None or vram <= 0:
        raise JobAdError(
            f"job {job_id} asks for a GPU but says nothing about GPU memory",
            hint="add `request_VRAM = <MiB>` or `gpus_minimum_memory = <MiB>` to the submit "
            "file, or install migd's access-point config (it sets MIGD_DEFAULT_VRAM)",
        )
    mode = str(job_ad.get("MigdMode", "auto")).lower()
    if mode not in MODES:
        raise JobAdError(f"MigdMode = {mode!r} is not one of {', '.join(MODES)}")
    # The lease goes on the GPU HTCondor assigned: with STARTER_HIDE_GPU_DEVICES (the
    # default) the starter leaves the job only that GPU's device files, so a partition
    # on another GPU would be unusable. Only a node that turned hiding off may let migd
    # choose (MigdPinToAssignedGPU = false).
    assigned = machine.get("AssignedGPUs")
    pin_flag = machine.get("MigdPinToAssignedGPU", True)
    pin = pin_flag is not False and str(pin_flag).strip().lower() not in ("false", "no", "0")
    gpus = (
        tuple(physical_gpu(g) for g in assigned.split(",") if g.strip())
        if pin and isinstance(assigned, str) and assigned.strip()
        else None
    )
    # HTCondor's RequestGPUs is a whole number of GPUs; the job gets one partition on
    # each (a fraction, which no submit file can make, counts as one).
    count = max(1, int(gpus_requested))
    if count > 64:
        raise JobAdError(f"RequestGPUs = {gpus_requested:g} is more GPUs than migd serves (64)")
    if gpus and count > 1:
        # member i goes on the GPU of the i-th assigned share; a GPU may repeat
        gpus_kept: tuple[str, ...] | None = gpus
    else:
        gpus_kept = tuple(dict.fromkeys(gpus)) if gpus else None
    horizon = _number(job_ad, "MigdHorizon", None)
    wait = _number(job_ad, "MigdWaitSeconds", None)
    return JobSpec(
        command=tuple(command),
        job_id=job_id,
        memory_mib=int(vram),
        slot=str(machine.get("Name", "")),
        min_compute=int(_number(job_ad, "MigdMinCompute", 0.0) or 0),
        mode=mode,
        gpus=gpus_kept,
        gpu_count=count,
        max_restarts=int(_number(job_ad, "MigdMaxRestarts", 3.0) or 0),
        early_restart=_flag(job_ad, "MigdEarlyRestart"),
        horizon=horizon,
        growth_factor=float(_number(job_ad, "MigdGrowthFactor", 0.0) or 0.0),
        wait_s=wait,
        under_condor=True,
        want_chirp=_flag(job_ad, "WantIOProxy"),
        oom_exits=int(_number(job_ad, "MigdOomExits", 0.0) or 0),
        oom_marker=_flag(job_ad, "MigdOomExit"),
        start_failures=int(_number(job_ad, "MigdStartFailures", 0.0) or 0),
        gpu_losses=int(_number(job_ad, "MigdGpuLosses", 0.0) or 0),
        lease_losses=int(_number(job_ad, "MigdLeaseLosses", 0.0) or 0),
        lease_lost_marker=_flag(job_ad, "MigdLeaseLost"),
        kill_sig=signal_number(job_ad.get("KillSig")),
        named_signals=named_signals(job_ad),
        stop_signals=named_signals(job_ad, STOP_ATTRS),
        **_checkpoint(job_ad),
    )


def _checkpoint(job_ad: Mapping[str, Any]) -> dict[str, Any]:
    """What makes an exit a checkpoint: ``SuccessCheckpointExitCode``, or with
    ``SuccessCheckpointExitBySignal`` the ``SuccessCheckpointExitSignal`` (what
    condor_submit 23.9 writes for ``checkpoint_exit_code``; the starter's
    ``computeDesiredExitStatus("Checkpoint", ...)`` compares the job's status with it)."""
    code = signum = None
    if _flag(job_ad, "SuccessCheckpointExitBySignal"):
        number = signal_number(job_ad.get("SuccessCheckpointExitSignal"), default=0)
        signum = number or None
    else:
        value = _number(job_ad, "SuccessCheckpointExitCode", None)
        code = int(value) if value is not None else None
    return {
        "checkpoint_exit_code": code,
        "checkpoint_exit_signal": signum,
        "checkpoint_vram": int(_number(job_ad, "MigdCheckpointVRAM", 0.0) or 0),
    }


def spec_from_flags(
    command: list[str],
    *,
    gpu_memory: str,
    job_id: str,
    mode: str = "auto",
    min_compute: int = 0,
    gpus: list[str] | None = None,
    max_restarts: int = 3,
    early_restart: bool = False,
    horizon: float | None = None,
    growth_factor: float = 0.0,
    wait_s: float | None = None,
    gpu_count: int = 1,
) -> JobSpec:
    """The request of ``migd-run --gpu-memory 10G -- cmd ...``.

    Raises:
        InvalidRequest: bad sizes or an empty command.
    """
    if not command:
        raise InvalidRequest("no command to run", hint="migd-run --gpu-memory 10G -- cmd args")
    if mode not in MODES:
        raise InvalidRequest(f"--mode must be one of {', '.join(MODES)}")
    memory = parse_mib(gpu_memory)
    if memory <= 0:
        raise InvalidRequest("--gpu-memory must be more than 0")
    if not 1 <= gpu_count <= 64:
        raise InvalidRequest(f"--gpus must be 1 to 64, got {gpu_count}")
    if gpu_count > 1 and mode == "mps":
        raise InvalidRequest(
            "--gpus above 1 cannot use MPS shares (one process reaches one MPS server)",
            hint="use --mode mig or auto",
        )
    return JobSpec(
        command=tuple(command),
        job_id=job_id,
        memory_mib=memory,
        mode=mode,
        min_compute=min_compute,
        gpus=tuple(gpus) if gpus else None,
        gpu_count=gpu_count,
        max_restarts=max_restarts,
        early_restart=early_restart,
        horizon=horizon,
        growth_factor=growth_factor,
        wait_s=wait_s,
    )
