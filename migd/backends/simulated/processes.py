"""Processes on the simulated node: CUDA contexts, their memory, and MPS servers.

:class:`Processes` (``node.procs``) is what CUDA programs on the node do: attach a
context to a device, allocate and free memory (refused as ``cudaMalloc`` refuses it),
exit. It also keeps MPS servers listed while their host process lives, and processes
left behind by a lease. NVML reads the same table (``nvmlDeviceGetComputeRunningProcesses``,
``nvmlDeviceGetMemoryInfo``). Errors a CUDA program would see are :class:`SimCudaError`.

A process that dies without detaching (killed by a signal: ``condor_rm``, a vacate, the
wrapper's SIGKILL) loses its context and memory as on a real GPU: the CUDA driver
destroys a process's contexts when it exits, and "destroys and cleans up all resources
associated with the context", its ``cuMemAlloc`` memory included (CUDA Driver API,
``cuCtxDestroy``); NVML lists only "processes with a compute context on a device"
(nvml.h, ``nvmlDeviceGetComputeRunningProcesses``). Every read NVML would answer
(memory, processes, a compute instance's IN_USE check, an allocation's room) first
drops the processes whose host process is gone (:meth:`Processes.drop_dead`). A process
that still runs keeps what it holds, whoever its parent is (an orphan that escaped
the wrapper). Only host processes are checked: a PID that was not a running host
process when it attached (a test's made-up PID, :meth:`Processes.leave_behind`) is
simulated and lives until it detaches.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from migd.backends.simulated.state import SimProcess
from migd.core.mps import MPS_SERVER_MIB
from migd.ports import ProcessTable

if TYPE_CHECKING:
    from migd.backends.simulated.node import SimNode

#: Memory an MPS server holds on its device: 66 MiB as NVML listed it on an H200
#: (migd.core.mps.MPS_SERVER_MIB, tests/data/mps_gpu_check/).
MPS_SERVER_USED_MIB = MPS_SERVER_MIB

#: PIDs of processes left behind (Processes.leave_behind) start above Linux's largest
#: pid_max (2^22), so they are never a host process.
LEFT_BEHIND_FIRST_PID = 1 << 22


class SimCudaError(RuntimeError):
    """An error a CUDA program on the simulated node would get (``CUDA error: ...``)."""


class SimOutOfMemory(SimCudaError):
    """``cudaErrorMemoryAllocation`` (2): the allocation does not fit.

    Raised past the MIG device's memory, past an MPS client's pinned-memory limit,
    or past a non-MIG GPU's memory, exactly where ``cudaMalloc`` would fail.
    """

    def __init__(
        self,
        *,
        pid: int,
        device_uuid: str,
        requested_mib: int,
        used_mib: int,
        limit_mib: int,
        limit: str,
    ) -> None:
        super().__init__(
            f"CUDA error: out of memory (pid {pid} tried to allocate {requested_mib} MiB on "
            f"{device_uuid}; {used_mib} MiB of the {limit} of {limit_mib} MiB already in use)"
        )
        self.pid = pid
        self.device_uuid = device_uuid
        self.requested_mib = requested_mib
        self.used_mib = used_mib
        self.limit_mib = limit_mib
        self.limit = limit


class Processes:
    """The processes of a :class:`~migd.backends.simulated.node.SimNode` (``node.procs``).

    Every public method takes the node lock (:meth:`drop_dead` takes it too: it is re-entrant).

    Args:
        node: the node the processes run on.
        host: the host's process table: whether a PID still runs (MPS servers, reloads).
    """

    def __init__(self, node: SimNode, host: ProcessTable) -> None:
        self.node = node
        self.host = host
        self._lock = node.lock
        self._left_behind = LEFT_BEHIND_FIRST_PID
        self.clear()

    def clear(self) -> None:
        """No processes (node reset). Left-behind PIDs keep counting up."""
        self.by_pid: dict[int, SimProcess] = {}

    def memory_mib(self, index: int, gi_serial: int | None = None) -> tuple[int, int]:
        """(total, used by processes) MiB of the whole GPU or of one GPU instance.

        NVML reports :meth:`reserved_mib` on top (``nvmlDeviceGetMemoryInfo``), and a
        CUDA allocation must fit beside both. Dead processes hold nothing.
        """
        with self._lock:
            self.drop_dead()
            gpu = self.node.gpus[index]
            if gi_serial is None:
                used = sum(p.used_mib for p in self.by_pid.values() if p.gpu == index)
                return gpu.spec.memory_total_mib, used
            _, gi = self.node.mig.lookup_gi(gi_serial)
            used = sum(p.used_mib for p in self.by_pid.values() if p.gi_serial == gi_serial)
            total = gpu.spec.mig_memory_mib.get(gi.profile.name, gi.profile.memory_mib)
            return total, used

    def reserved_mib(self, index: int, gi_serial: int | None = None) -> int:
        """MiB the driver holds on an idle device: ``idle_used_mib`` on a whole GPU,
        ``mig_idle_used_mib`` per GPU instance (a MIG parent adds up its instances')."""
        with self._lock:
            gpu = self.node.gpus[index]
            spec = gpu.spec
            if gi_serial is not None:
                return spec.mig_idle_used_mib
            if gpu.mig_current:
                return spec.mig_idle_used_mib * len(gpu.instances)
            return spec.idle_used_mib

    def processes_on(self, index: int, ci_serial: int | None = None) -> list[SimProcess]:
        """Processes on GPU ``index`` (all of them) or on one MIG device."""
        with self._lock:
            self.drop_dead()
            return [
                p
                for p in self.by_pid.values()
                if p.gpu == index and (ci_serial is None or p.ci_serial == ci_serial)
            ]

    def attach(
        self,
        pid: int,
        device_uuid: str,
        mps_pinned_limit_mib: int | None = None,
        *,
        mps: bool | None = None,
    ) -> None:
        """Process ``pid`` creates a CUDA context on ``device_uuid`` (a MIG or GPU UUID).

        ``mps_pinned_limit_mib`` makes it an MPS client with that pinned-memory limit
        (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``); ``mps=True`` makes it an MPS client
        without a limit.

        Raises:
            SimCudaError: the UUID names no usable device (e.g. a MIG-mode parent GPU,
                which CUDA cannot use), or the GPU is lost.
            ValueError: ``pid`` already has a context.
        """
        with self._lock:
            self.drop_dead()  # a dead process's PID may be a new process's now
            if pid in self.by_pid:
                raise ValueError(f"pid {pid} is already attached")
            found = self.node.mig.by_uuid.get(device_uuid)
            if found is not None:
                gpu, gi, ci = found
                proc = SimProcess(pid, gpu.index, gi.serial, ci.serial, device_uuid)
            else:
                gpu_match = next((g for g in self.node.gpus if g.uuid == device_uuid), None)
                if gpu_match is None:
                    raise SimCudaError(f"CUDA error: invalid device ordinal ({device_uuid})")
                if gpu_match.mig_current:
                    # With MIG on, CUDA enumerates MIG devices only; the parent is not usable.
                    raise SimCudaError(
                        "CUDA error: no CUDA-capable device is detected "
                        f"({device_uuid} is in MIG mode)"
                    )
                gpu = gpu_match
                proc = SimProcess(pid, gpu.index, None, None, device_uuid)
            if gpu.lost:
                raise SimCudaError("CUDA error: unspecified launch failure (GPU is lost)")
            proc.mps = bool(mps) if mps is not None else mps_pinned_limit_mib is not None
            proc.mps_pinned_limit_mib = mps_pinned_limit_mib
            # A host process is known by its start (PID reuse guard); it frees its
            # memory when it dies (drop_dead). None: a simulated PID, never checked.
            proc.host_start_s = self.host.start_time(pid)
            self.by_pid[pid] = proc
            self.node.save()

    def track_mps_servers(self, device_uuid: str, pids: Iterable[int]) -> None:
        """MPS servers run on ``device_uuid`` (a GPU or MIG UUID): each is an NVML compute
        process there until its host process exits.

        "The MPS server ... creates the shared GPU context" and clients are listed
        against it (docs.nvidia.com/deploy/mps, "Architecture"); NVML lists the server
        on the device it runs on, so a MIG instance that hosted MPS is IN_USE until the
        server has exited, which happens a moment after its control daemon's ``quit``.
        The simulated server holds :data:`MPS_SERVER_USED_MIB` (66 MiB, as recorded on an
        H200). Known PIDs are ignored; a PID that is not a live
        host process is not added.

        Raises:
            SimCudaError: the UUID names no usable device.
        """
        with self._lock:
            for pid in pids:
                if pid in self.by_pid or not self.host.alive(pid):
                    continue
                self.attach(pid, device_uuid)
                proc = self.by_pid[pid]
                proc.mps_server = True
                proc.used_mib = MPS_SERVER_USED_MIB
                proc.host_start_s = self.host.start_time(pid)
            self.node.save()

    def drop_dead(self) -> list[int]:
        """Forget the processes whose host process has exited, with their contexts and
        memory, as the driver does (see the module docstring); the caller holds the lock.
        Returns their PIDs."""
        with self._lock:
            gone = [
                pid
                for pid, proc in self.by_pid.items()
                # (an MPS server was checked by its PID even when its start is unknown)
                if (proc.host_start_s is not None or proc.mps_server)
                and not self.host.alive(pid, proc.host_start_s)
            ]
            for pid in gone:
                del self.by_pid[pid]
            if gone:
                self.node.save()
            return gone

    def leave_behind(self, device_uuid: str, used_mib: int) -> int:
        """A process that outlives its lease: it holds ``used_mib`` on ``device_uuid`` until
        :meth:`detach` (e.g. a job's child that escaped the wrapper's kill).

        Real GPUs keep such a process's context and memory whatever migd's books say; the
        daemon must then quarantine the instance, never destroy or reuse it. The PID is
        a purely simulated one (above Linux's largest ``pid_max``, 2^22), so it is never
        a host process; a node reloaded from ``state_file`` drops it like any dead PID.

        Returns:
            the process's PID.

        Raises:
            SimCudaError: the UUID names no usable device.
            SimOutOfMemory: ``used_mib`` does not fit on the device.
        """
        with self._lock:
            self._left_behind += 1
            pid = self._left_behind
            self.attach(pid, device_uuid)
            try:
                self.alloc(pid, used_mib)
            except SimCudaError:
                self.detach(pid)
                raise
            return pid

    def alloc(self, pid: int, mib: int) -> None:
        """``cudaMalloc`` of ``mib`` MiB by ``pid``.

        Raises:
            SimOutOfMemory: past the MPS client's pinned limit, or past the device's
                memory (MIG instance memory, or the whole GPU without MIG).
            ValueError: ``pid`` is not attached or ``mib`` is negative.
        """
        if mib < 0:
            raise ValueError("allocation size must not be negative")
        with self._lock:
            proc = self._attached(pid)
            if self.node.gpus[proc.gpu].lost:
                raise SimCudaError("CUDA error: unspecified launch failure (GPU is lost)")
            limit = proc.mps_pinned_limit_mib
            if limit is not None and proc.used_mib + mib > limit:
                raise SimOutOfMemory(
                    pid=pid,
                    device_uuid=proc.device_uuid,
                    requested_mib=mib,
                    used_mib=proc.used_mib,
                    limit_mib=limit,
                    limit="MPS pinned-memory limit",
                )
            total, used = self.memory_mib(proc.gpu, proc.gi_serial)
            used += self.reserved_mib(proc.gpu, proc.gi_serial)
            if used + mib > total:
                raise SimOutOfMemory(
                    pid=pid,
                    device_uuid=proc.device_uuid,
                    requested_mib=mib,
                    used_mib=used,
                    limit_mib=total,
                    limit="device memory",
                )
            proc.used_mib += mib
            self.node.save()

    def free(self, pid: int, mib: int) -> None:
        """``cudaFree`` of ``mib`` MiB.

        Raises:
            ValueError: more than the process holds, or not attached.
        """
        with self._lock:
            proc = self._attached(pid)
            if not 0 <= mib <= proc.used_mib:
                raise ValueError(f"pid {pid} holds {proc.used_mib} MiB, cannot free {mib}")
            proc.used_mib -= mib
            self.node.save()

    def detach(self, pid: int) -> None:
        """The process exits: its context and memory go away (no error if not attached)."""
        with self._lock:
            if self.by_pid.pop(pid, None) is not None:
                self.node.save()

    def _attached(self, pid: int) -> SimProcess:
        proc = self.by_pid.get(pid)
        if proc is None:
            raise ValueError(f"pid {pid} has no CUDA context on this node")
        return proc


__all__ = [
    "LEFT_BEHIND_FIRST_PID",
    "MPS_SERVER_USED_MIB",
    "Processes",
    "SimCudaError",
    "SimOutOfMemory",
]
