"""The simulated GPU frees what a dead process held, as the driver does (issue 21 §4): a
fake CUDA job killed by a signal (it never detaches) leaves no context and no memory at
the next read NVML would answer; a process that still runs (an orphan whose parent
exited) keeps both; a PID given to a new process is not the old one's."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from migd.backends.simulated import SimNode, simulated_backend
from tests.backends.test_sim_persistence import HostTable
from tests.process.conftest import wait_for

Sleepers = list[subprocess.Popen[bytes]]


@pytest.fixture
def sleepers() -> Iterator[Sleepers]:
    """Processes the test started (killed and reaped afterwards)."""
    procs: Sleepers = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


def sleeper(sleepers: Sleepers) -> int:
    proc = subprocess.Popen(["sleep", "60"])
    sleepers.append(proc)
    return proc.pid


def kill(sleepers: Sleepers, pid: int) -> None:
    """SIGKILL (condor_rm, a vacate: no cudaFree, no detach) and reap."""
    [proc] = [p for p in sleepers if p.pid == pid]
    proc.kill()
    proc.wait()


def gi_of(node: SimNode) -> int:
    return next(iter(node.mig.gi_by_serial))


def test_a_job_killed_by_a_signal_frees_its_memory_and_context(sleepers: Sleepers) -> None:
    backend, node = simulated_backend("1xA100-40GB")
    backend.discover()
    inst = backend.create_instance(0, 9, 0)  # 3g.20gb@0
    job = sleeper(sleepers)
    node.attach(job, inst.uuid or "")
    node.alloc(job, 15_000)
    gi = gi_of(node)
    assert node.memory_mib(0, gi)[1] == 15_000
    assert backend.processes(0, inst.uuid) != []

    kill(sleepers, job)

    # Every read NVML answers: memory, the process list, a compute instance's IN_USE.
    assert node.memory_mib(0, gi)[1] == 0
    assert node.procs.processes_on(0) == []
    assert backend.processes(0, inst.uuid) == []
    assert node.process(job) is None
    # The room is there again for the next job's allocation.
    other = sleeper(sleepers)
    node.attach(other, inst.uuid or "")
    node.alloc(other, 15_000)
    node.detach(other)
    # The instance itself stays (a process exiting never destroys an instance) and can
    # now be destroyed: nothing is IN_USE.
    assert [i.uuid for i in backend.list_instances(0)] == [inst.uuid]
    backend.destroy_instance(0, inst.gi_id)
    assert backend.list_instances(0) == []


def test_an_orphan_that_still_runs_keeps_its_memory() -> None:
    node = SimNode.from_description("1xV100-32GB")
    uuid = node.gpu(0).uuid
    # The shell exits at once; its background child runs on, reparented (an orphan).
    out = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = int(out.stdout)
    try:
        node.attach(orphan, uuid)
        node.alloc(orphan, 4096)
        assert node.memory_mib(0)[1] == 4096
        assert [p.pid for p in node.procs.processes_on(0)] == [orphan]
    finally:
        os.kill(orphan, signal.SIGKILL)
    # Not our child: its new parent reaps it, so wait for the kernel to say so.
    wait_for(lambda: node.memory_mib(0)[1] == 0, 60.0, "the killed orphan's memory freed")
    assert node.procs.processes_on(0) == []


def test_a_pid_reused_by_a_new_process_is_not_the_dead_ones() -> None:
    host = HostTable({321: 50.0, 654: 60.0})
    node = SimNode.from_description("1xV100-32GB", host_processes=host)
    for pid in (321, 654):
        node.attach(pid, node.gpu(0).uuid)
        node.alloc(pid, 1000)
    host.starts[321] = 75.0  # 321 exited; a new process got its PID
    assert node.memory_mib(0)[1] == 1000
    assert [p.pid for p in node.procs.processes_on(0)] == [654]
    node.attach(321, node.gpu(0).uuid)  # the new process may create its own context
    assert node.process(321) is not None and node.process(321).used_mib == 0  # type: ignore[union-attr]


def test_a_simulated_pid_lives_until_it_detaches() -> None:
    # Not a host process when it attached (a test's made-up PID, leave_behind): nothing
    # on the host can end it, only detach.
    node = SimNode.from_description("1xV100-32GB", host_processes=HostTable())
    node.attach(4_000_000, node.gpu(0).uuid)
    node.alloc(4_000_000, 500)
    left = node.procs.leave_behind(node.gpu(0).uuid, 700)
    assert node.memory_mib(0)[1] == 1200
    node.detach(4_000_000)
    node.detach(left)
    assert node.memory_mib(0)[1] == 0


def test_nvml_reads_through_the_fake_pynvml_free_a_dead_processs_memory(
    sleepers: Sleepers,
) -> None:
    from migd.backends.simulated import FakePynvml

    node = SimNode.from_description("1xV100-32GB")
    nvml = FakePynvml(node)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(0)
    job = sleeper(sleepers)
    node.attach(job, node.gpu(0).uuid)
    node.alloc(job, 2048)
    used = nvml.nvmlDeviceGetMemoryInfo(handle).used
    assert [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)] == [job]
    kill(sleepers, job)
    assert nvml.nvmlDeviceGetComputeRunningProcesses(handle) == []
    assert nvml.nvmlDeviceGetMemoryInfo(handle).used == used - 2048 * 1024 * 1024
