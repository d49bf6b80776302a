"""Which signals the wrapper passes on, how it reports the job's end, and the job ad
fields behind both (migd.wrapper.signals, migd.wrapper.exit_status)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from migd.wrapper.exit_status import JobEnd, read_pid_ns_status, record_for_starter
from migd.wrapper.jobspec import spec_from_ads
from migd.wrapper.signals import (
    NEVER,
    PID_NS_INIT_SIGNALS,
    PID_NS_STATUS_ENV,
    STOP_SIGNALS,
    forward_plan,
    named_signals,
    under_pid_ns_init,
)

RT = int(signal.SIGRTMIN) + 3


def test_every_signal_the_job_ad_names_is_passed_on_whatever_its_number() -> None:
    ad = {"KillSig": "SIGALRM", "RemoveKillSig": "WINCH", "HoldKillSig": 10, "CheckpointSig": RT}
    named = named_signals(ad)
    assert named == {signal.SIGALRM, signal.SIGWINCH, signal.SIGUSR1, RT}
    plan = forward_plan(named, stop=named_signals(ad, ("KillSig", "RemoveKillSig", "HoldKillSig")))
    assert named <= plan.forwarded
    # the kill signals stop the job (no restart after them); the checkpoint signal does not
    assert {signal.SIGALRM, signal.SIGWINCH, signal.SIGUSR1} <= plan.stopping
    assert RT not in plan.stopping and set(STOP_SIGNALS) <= plan.stopping
    # terminal and suspend signals reach the job too
    assert {signal.SIGTSTP, signal.SIGCONT, signal.SIGTTIN} <= plan.forwarded


def test_uncatchable_and_own_signals_are_not_handled_unless_named() -> None:
    plan = forward_plan()
    assert not plan.forwarded & NEVER
    # a fault or a write to a closed pipe in the wrapper is the wrapper's own
    assert signal.SIGSEGV not in plan.forwarded and signal.SIGPIPE not in plan.forwarded
    named = forward_plan([signal.SIGSEGV, signal.SIGKILL])
    assert signal.SIGSEGV in named.forwarded and signal.SIGKILL not in named.forwarded


def test_under_condor_pid_ns_init_exactly_its_signals_go_to_it_alone() -> None:
    # condor_pid_ns_init.cpp installs handlers for these ten and passes them to the job;
    # as PID 1 it never receives any other, so neither does the job without migd.
    plan = forward_plan([signal.SIGALRM], pid_ns_init=True)
    assert plan.forwarded == {int(s) for s in PID_NS_INIT_SIGNALS}
    assert plan.child_only


@pytest.mark.parametrize(
    ("value", "expected"),
    [("SIGALRM", {signal.SIGALRM}), ("14", {signal.SIGALRM}), ("NOPE", set()), (True, set())],
)
def test_named_signal_spellings(value: object, expected: set[int]) -> None:
    assert named_signals({"KillSig": value}) == expected


def test_pid_ns_init_is_recognised_only_by_its_name_and_variable() -> None:
    env = {PID_NS_STATUS_ENV: "/scratch/.condor_pid_ns_status"}
    assert under_pid_ns_init(["/usr/libexec/condor/condor_pid_ns_init", "job"], env)
    assert not under_pid_ns_init(["/usr/bin/python3", "job"], env)  # migd-run in such a job
    assert not under_pid_ns_init(["/usr/libexec/condor/condor_pid_ns_init"], {})


def test_wait_status_round_trips_for_every_code_and_signal() -> None:
    # exhaustive over what a process can end with
    for code in range(256):
        status = JobEnd(exit_code=code).wait_status
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == code
        assert JobEnd.from_wait_status(status) == JobEnd(exit_code=code)
    for sig in signal.valid_signals():
        end = JobEnd(signum=int(sig))
        assert os.WIFSIGNALED(end.wait_status) and os.WTERMSIG(end.wait_status) == sig
        assert JobEnd.from_wait_status(end.wait_status) == end
        assert JobEnd.from_returncode(-int(sig)) == end


def test_pid_ns_status_file_is_written_only_for_the_wrapper_of_condor_pid_ns_init(
    tmp_path: Path,
) -> None:
    status = tmp_path / ".condor_pid_ns_status"
    env = {PID_NS_STATUS_ENV: str(status)}
    record_for_starter(JobEnd(exit_code=86), ["/bin/job"], env)
    assert not status.exists()
    record_for_starter(JobEnd(exit_code=86), ["/x/condor_pid_ns_init", "/bin/job"], env)
    # what the starter's pidNameSpaceReaper reads with fscanf("Exited: %d")
    assert status.read_text() == f"Exited: {86 << 8}\n"
    assert read_pid_ns_status(status) == JobEnd(exit_code=86)
    record_for_starter(JobEnd(signum=9), ["/x/condor_pid_ns_init", "/bin/job"], env)
    assert read_pid_ns_status(status) == JobEnd(signum=9)
    status.write_text("ExecFailed: 2\n")
    assert read_pid_ns_status(status) is None
    assert read_pid_ns_status(tmp_path / "missing") is None


def test_job_ad_checkpoint_and_signal_fields() -> None:
    base = {"ClusterId": 1, "ProcId": 0, "RequestGPUs": 1, "RequestVRAM": 4000}
    plain = spec_from_ads(["job"], base, None)
    assert not plain.checkpoints and plain.named_signals == frozenset()
    spec = spec_from_ads(
        ["job"],
        {
            **base,
            "SuccessCheckpointExitCode": 85,
            "MigdCheckpointVRAM": 9984,
            "KillSig": "SIGALRM",
            "CheckpointSig": "SIGUSR2",
        },
        None,
    )
    assert spec.checkpoints and spec.checkpoint_exit_code == 85
    assert spec.checkpoint_exit_signal is None and spec.checkpoint_vram == 9984
    assert spec.named_signals == {signal.SIGALRM, signal.SIGUSR2}
    assert spec.stop_signals == {signal.SIGALRM}
    by_signal = spec_from_ads(
        ["job"],
        {**base, "SuccessCheckpointExitBySignal": True, "SuccessCheckpointExitSignal": 10},
        None,
    )
    assert by_signal.checkpoint_exit_signal == signal.SIGUSR1
    assert by_signal.checkpoint_exit_code is None


def _status(queue_job: str | None) -> dict[str, object]:
    gpus = [
        {"index": 0, "uuid": "GPU-aaaa1111-x", "healthy": True, "largest_placeable": None},
        {
            "index": 1,
            "uuid": "GPU-bbbb2222-y",
            "healthy": True,
            "largest_placeable": {"memory_mib": 40448, "profile": "7g.40gb"},
        },
    ]
    queue = [{"job_id": queue_job, "position": 2}] if queue_job else []
    return {"gpus": gpus, "queue": queue, "queue_summary": {"length": 3}}


def test_wait_reason_names_the_queue_place_and_a_gpu_that_could_serve_now() -> None:
    from migd.wrapper.wait_notice import wait_reason

    reason = wait_reason(_status("7.0"), "7.0", 40000, ("GPU-aaaa1111",))
    assert "no free partition of 40000 MiB on GPU GPU-aaaa1111" in reason
    assert "position 2 of 3 in migd's queue" in reason
    # HTCondor pinned it to the busy GPU while GPU 1 is free (issue 22 §7)
    assert "GPU 1 of this node could serve it now" in reason
    # not pinned, or nothing else fits: no such note
    assert "could serve" not in wait_reason(_status(None), "7.0", 40000, None)
    assert "could serve" not in wait_reason(_status(None), "7.0", 50000, ("GPU-aaaa1111",))
    assert "making or freeing one" in wait_reason(_status(None), "7.0", 50000, None)
