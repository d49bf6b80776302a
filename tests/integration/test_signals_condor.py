"""Signals, exit status and checkpoints through a real HTCondor 23.9 pool, with and
without migd: each job shape runs twice in the same pool, once as a GPU job (through
migd's forking wrapper) and once without a GPU (the wrapper ``exec``s it: HTCondor's
own behaviour), and ``condor_history`` must record the same end for both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from condor_pool import CondorChroot, PersonalPool
from test_migd_condor import Migd, gpu_pool, migd_slots

pytestmark = pytest.mark.htcondor

JOBS = {
    "exit3.sh": "#!/bin/sh\nexit 3\n",
    "segv.sh": "#!/bin/sh\nkill -SEGV $$\nsleep 5\n",
    "kill.sh": "#!/bin/sh\nkill -KILL $$\nsleep 5\n",
    # kill_sig = SIGALRM: the job says it got it (the old wrapper died of SIGALRM itself)
    "alrm.sh": "#!/bin/sh\ntrap 'echo got ALRM > got-$1; exit 0' ALRM\n"
    "echo running > running-$1\nwhile true; do sleep 0.2; done\n",
    # checkpoint_exit_code = 85: checkpoint once, then finish from the checkpoint
    "ckpt.sh": "#!/bin/sh\nif [ -f ckpt ]; then echo resumed; exit 0; fi\n"
    "echo state > ckpt\necho 'RuntimeError: CUDA out of memory. Tried to allocate 1 GiB' >&2\n"
    "exit 85\n",
}
RECORDED = ("ExitCode", "ExitBySignal", "ExitSignal", "JobStatus")


@pytest.fixture(scope="module")
def installed(migd_installed: CondorChroot) -> CondorChroot:
    return migd_installed


@pytest.fixture
def migd(installed: CondorChroot) -> Iterator[Migd]:
    daemon = Migd(installed)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        print(daemon.log()[-20000:])


def job(script: str, gpu: bool, *, transfer: bool = True, **submit: str) -> dict[str, str]:
    sub = {"executable": script, "request_cpus": "1", "request_memory": "64"}
    if transfer:  # (checkpoint files need file transfer; else the job runs in its dir)
        sub.update({"should_transfer_files": "YES", "when_to_transfer_output": "ON_EXIT_OR_EVICT"})
    sub.update(submit)
    if gpu:
        sub.update({"request_GPUs": "1", "request_VRAM": "4000"})
    return sub


def recorded(ad: dict[str, Any]) -> dict[str, Any]:
    return {k: ad.get(k) for k in RECORDED}


def run_both(pool: PersonalPool, script: str, **submit: str) -> tuple[dict[str, Any], ...]:
    out = []
    for gpu in (True, False):
        cluster = pool.submit(job(script, gpu, **submit), files=JOBS)
        [ad] = pool.wait(cluster, timeout=180)
        out.append(ad)
    return tuple(out)


def check_shapes(pool: PersonalPool, migd: Migd) -> None:
    for script, expected in (
        ("exit3.sh", {"ExitCode": 3, "ExitBySignal": False}),
        ("segv.sh", {"ExitBySignal": True, "ExitSignal": 11}),
        ("kill.sh", {"ExitBySignal": True, "ExitSignal": 9}),
    ):
        with_migd, without = run_both(pool, script)
        assert recorded(with_migd) == recorded(without), (script, with_migd, without)
        assert {k: with_migd.get(k) for k in expected} == expected, (script, with_migd)
    # condor_rm with kill_sig = SIGALRM: the job hears it with and without migd
    for gpu in (True, False):
        cluster = pool.submit(
            job("alrm.sh", gpu, transfer=False, kill_sig="SIGALRM", arguments=str(int(gpu))),
            files=JOBS,
        )
        pool.wait_for(
            lambda c=cluster, g=gpu: pool.job_file(c, f"running-{int(g)}"),
            timeout=120,
            what="the job to run",
        )
        pool.rm(cluster)
        pool.wait_for(
            lambda c=cluster, g=gpu: (
                "got ALRM" in pool.job_file(c, f"got-{int(g)}") or not pool.q(c)
            ),
            timeout=120,
            what="the removal",
        )
        assert "got ALRM" in pool.job_file(cluster, f"got-{int(gpu)}"), (gpu, pool.q(cluster))
    # checkpoint_exit_code: the checkpoint exit is not an OOM failure; it resumes and ends 0
    with_migd, without = run_both(
        pool, "ckpt.sh", checkpoint_exit_code="85", transfer_checkpoint_files="ckpt"
    )
    assert recorded(with_migd) == recorded(without) == {**recorded(without), "ExitCode": 0}
    assert with_migd.get("MigdCheckpointVRAM", 0) >= 4000, with_migd
    assert migd.leases() == []


def test_exit_status_signals_and_checkpoints_as_without_migd(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    pool = gpu_pool(personal_pool)
    migd_slots(pool)
    check_shapes(pool, migd)


def test_the_same_with_pid_namespaces(
    migd: Migd, personal_pool: Callable[..., PersonalPool]
) -> None:
    # The wrapper is PID 1 and condor_pid_ns_init its child; the starter reads the job's
    # end from condor_pid_ns_init's status file.
    pool = gpu_pool(personal_pool, "USE_PID_NAMESPACES = True\n")
    migd_slots(pool)
    # Where the starter cannot make a PID namespace (a container without CLONE_NEWPID for
    # it), every job, with or without migd, is held "Failed to execute ... errno=22";
    # then there is nothing to compare (tests/process/test_wrapper_signals.py covers the
    # wrapper as PID 1 with unshare instead).
    probe = pool.submit(job("exit3.sh", False), files=JOBS)
    [ad] = pool.wait(probe, timeout=120)
    if ad.get("JobStatus") == 5 and "Failed to execute" in str(ad.get("HoldReason")):
        pytest.skip(f"the starter cannot use PID namespaces here: {ad['HoldReason']}")
    check_shapes(pool, migd)
