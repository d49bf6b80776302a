"""Run one job on a migd partition: lease, supervise, detect OOM, restart bigger, release.

The job runs as a child in its own process group; every signal HTCondor may send
(the job ad's kill, remove, hold and checkpoint signals, whatever their numbers,
and any other catchable signal) is passed on (:mod:`migd.wrapper.signals`).
Its stderr is teed to ours (the job's error file) through a ring buffer that
the OOM classifier reads. Exit: the job's exit code, or its signal re-raised on
ourselves, so HTCondor records what the job did (:mod:`migd.wrapper.exit_status`,
also under ``USE_PID_NAMESPACES``). A checkpoint exit (``checkpoint_exit_code``)
passes straight through, and the run HTCondor starts after it asks for a
partition at least as large (``MigdCheckpointVRAM``). The lease is released on every
path; if we are SIGKILLed, the JOB_EXIT hook and then migd's reaper release it.
What it asks of migd about the lease (the lease call, the lease as migd sees it, the
job's memory on it, the release) is :mod:`migd.wrapper.leasing`.

Exit codes of our own (documented in docs/wrapper.md):

* 86 (``OOM_EXIT_CODE``): the job ran out of GPU memory and nothing bigger is
  available on this node (or the restarts are used up); ``RequestVRAM`` was
  raised and ``MigdOomExit`` set through chirp so HTCondor can re-match it
  (``condor_config/20-migd-access-point.config`` requeues it, and holds it at the
  largest size).
* 85 (``LEASE_LOST_EXIT_CODE``) with ``$_CONDOR_WRAPPER_ERROR_FILE`` written: migd
  took the job's lease back while it ran (an admin released it, it expired, its
  instance disappeared, its GPU failed: any end the job did not ask for, see
  :mod:`migd.core.lease_end`); the wrapper stopped the job (its ``kill_sig``, then
  SIGKILL after ``term_grace_s``) and set ``MigdLeaseLost`` and the reason through
  chirp. HTCondor shows the reason and runs the job again (the access-point config
  requeues an exit 85 with ``MigdLeaseLost`` too, should the error file be missed).
* 1 with ``$_CONDOR_WRAPPER_ERROR_FILE`` written: migd could not serve the job
  (daemon down, request impossible, MPS share unusable); HTCondor shows the reason
  and runs the job again.
* 127 (126): the job's executable does not exist (cannot be executed); the job
  failed, not migd.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from migd.client import MigdClient
from migd.core.forecast import Forecaster, MemorySample, Verdict
from migd.core.lease_end import LeaseEndReason, StopPlan
from migd.core.oom import OomVerdict, TailBuffer, classify_exit
from migd.core.restart import RestartSize, restart_size
from migd.errors import (
    MigdError,
    RequestTooLarge,
)
from migd.wrapper.containers import container_env
from migd.wrapper.exit_status import (
    JobEnd,
    die_of,
    pid_ns_status_path,
    read_pid_ns_status,
    record_for_starter,
)
from migd.wrapper.jobspec import JobSpec
from migd.wrapper.leasing import JobLeases, NoBigger, WrapperFailure, members
from migd.wrapper.settings import WrapperSettings
from migd.wrapper.signals import ForwardPlan, forward_plan, under_pid_ns_init

OOM_EXIT_CODE = 86
LEASE_LOST_EXIT_CODE = 85
ENV_TWINS = ("APPTAINERENV_", "SINGULARITYENV_")
# The first samples come sooner than sample_interval_s, so a job that fails within
# seconds still has a measured peak.
EARLY_SAMPLES_S = (0.25, 0.5, 1.0)

AttrSetter = Callable[[Mapping[str, str | int | bool]], str]
AttrGetter = Callable[[str], str | None]


def partition_attrs(lease: Mapping[str, Any], restarts: int) -> dict[str, str | int | bool]:
    """Job-ad attributes for the partition a lease holds (set through chirp).

    ``MigdPartitionProfile`` (``1g.10gb``, ``mps``, ``whole-gpu``),
    ``MigdPartitionMB`` (its memory limit), ``MigdPartitionMode`` (``mig``, ``mps``,
    ``exclusive``) and ``MigdRestarts`` (on-node restarts so far in this run).
    """
    mode = str(lease.get("mode") or "")
    profile = lease.get("profile") or {"mps": "mps", "exclusive": "whole-gpu"}.get(mode, mode)
    return {
        "MigdPartitionProfile": str(profile),
        "MigdPartitionMB": int(lease.get("memory_limit_mib") or 0),
        "MigdPartitionMode": mode,
        "MigdRestarts": restarts,
    }


class StopRequested(Exception):
    """A stop signal arrived while waiting for a lease (no job was running)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _JobNotStarted(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


@dataclass
class Attempt:
    lease: dict[str, Any]
    exit_code: int | None = None
    signum: int | None = None
    peak_used_mib: int | None = None
    oom: OomVerdict | None = None
    forecast: Verdict | None = None
    forecast_step: float | None = None  # the step the forecast had seen when it fired
    stopped: bool = False  # a stop signal came from outside
    # migd took the lease back while the job ran and the wrapper stopped the job
    taken_back: StopPlan | None = None
    tail: bytes = b""


class JobRunner:
    def __init__(
        self,
        spec: JobSpec,
        client: MigdClient,
        *,
        settings: WrapperSettings | None = None,
        set_job_attrs: AttrSetter | None = None,
        get_job_attr: AttrGetter | None = None,
        err: IO[bytes] | None = None,
    ) -> None:
        self.spec = spec
        self.client = client
        self.settings = settings or WrapperSettings()
        self.set_job_attrs = set_job_attrs
        self.get_job_attr = get_job_attr
        self.err = err or sys.stderr.buffer
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None
        self._interruptible = False  # a stop signal may abort the current lease wait
        self._old_handlers: dict[int, Any] = {}
        self._chirped: dict[str, str | int | bool] = {}
        # condor_pid_ns_init (USE_PID_NAMESPACES) between us and the job: it passes the
        # signals on and writes the job's real end to its status file.
        self.pid_ns_init = under_pid_ns_init(spec.command, os.environ)
        self.forward: ForwardPlan = forward_plan(
            spec.named_signals | {spec.kill_sig},
            pid_ns_init=self.pid_ns_init,
            stop=spec.stop_signals | {spec.kill_sig},
        )
        self.leases = JobLeases(
            spec, client, self.settings, say=self.say, debug=self.debug, chirp=self._chirp
        )

    # -- messages ---------------------------------------------------------------------------

    def say(self, message: str) -> None:
        """One line on the job's stderr, so the user sees what migd did."""
        with contextlib.suppress(OSError, ValueError):
            self.err.write(f"[migd] {message}\n".encode())
            self.err.flush()

    def debug(self, message: str) -> None:
        if self.settings.debug:
            self.say(f"debug: {message}")

    # -- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        del frame
        stopping = signum in self.forward.stopping
        if stopping:
            self.stop_signal = signum
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                self.forward.send(child.pid, signum)
        elif stopping and self._interruptible:
            # Only a wait for a lease is cut short; anywhere else (releasing, between
            # attempts) the run notices stop_signal and ends by re-raising it.
            self._interruptible = False
            raise StopRequested(signum)

    def _install_handlers(self) -> None:
        for sig in sorted(self.forward.forwarded):
            try:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (OSError, ValueError):  # reserved here (a libc's real-time signals)
                continue

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def reraise(self, signum: int) -> None:
        """Die of ``signum`` so HTCondor records ExitBySignal like the job's."""
        self._restore_handlers()
        with contextlib.suppress(OSError, ValueError):
            self.err.flush()
        record_for_starter(JobEnd(signum=signum), self.spec.command)
        die_of(signum)

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to completion (with restarts); the exit code to return.

        Raises:
            WrapperFailure: migd could not give the job a partition.
            StopRequested: HTCondor stopped us while we waited for a partition.
        """
        self._install_handlers()
        try:
            if self.spec.oom_marker:
                # This run is not the out-of-memory exit the marker speaks of.
                self._chirp({"MigdOomExit": False})
            if self.spec.lease_lost_marker:
                self._chirp({"MigdLeaseLost": False})  # nor the lease loss it speaks of
            return self._run()
        except WrapperFailure as exc:
            if exc.exit_code not in (OOM_EXIT_CODE, LEASE_LOST_EXIT_CODE) and exc.start_failure:
                # Counted so the access point holds a job migd keeps failing to start,
                # and only such a job (evictions for other reasons do not count).
                self._chirp(
                    {
                        "MigdStartFailures": self.spec.start_failures + 1,
                        "MigdStartFailureReason": " ".join(exc.message.split())[:500],
                    }
                )
            raise
        finally:
            self._restore_handlers()

    def _run(self) -> int:
        spec = self.spec
        memory = self._resume_size(spec.memory_mib)
        restarts = weak_restarts = 0
        peak = 0
        size: RestartSize | None = None
        limit = memory
        while True:
            try:
                lease = self.leases.acquire(
                    memory, first=size is None, interruptible=self._interruptible_wait
                )
            except WrapperFailure as exc:
                if not (
                    size is None
                    and memory > spec.memory_mib
                    and isinstance(exc.__cause__, RequestTooLarge)
                ):
                    raise
                # Only the size remembered from a checkpoint on another node is too
                # large here: what the job was matched with still fits.
                self.say(
                    f"no partition of the {memory} MiB the last checkpoint held fits here "
                    f"({exc.__cause__.message}); asking for the {spec.memory_mib} MiB requested"
                )
                memory = spec.memory_mib
                continue
            except NoBigger as exc:
                assert size is not None  # only a restart raises it
                self.say(str(exc))
                return self._give_up(limit, size.wanted_mib, "nothing bigger became free")
            if self.spec.start_failures:
                # migd served it: the access point's loop breaker counts failures in a row.
                self._chirp({"MigdStartFailures": 0})
            # What the job holds now, in its ad (condor_q, condor_history): the slot's VRAM
            # keeps the size it was matched with, even after a restart on a bigger partition.
            self._chirp(partition_attrs(lease, restarts))
            # Per GPU; a multi-GPU job's smallest partition is the one it outgrows first.
            limit = min(int(m.get("memory_limit_mib") or memory) for m in members(lease))
            try:
                attempt = self._supervise(lease)
                # While the lease is still active, migd hears what the wrapper knows the
                # attempt used (its samples, what the OOM message says the job held), so
                # the peak migd records at the release is never below it. (Usage only:
                # the release reply's peak is usage, and restart sizing adds the failed
                # allocation to it.)
                self._classify(attempt, limit)
                self._report(lease, "exit", attempt, None)
            except _JobNotStarted as exc:
                self.say(exc.message)
                return exc.exit_code
            finally:
                released = self.leases.release(lease, "job attempt ended")
            daemon_peak = released.get("peak_used_mib")
            if isinstance(daemon_peak, int) and daemon_peak > (attempt.peak_used_mib or 0):
                # migd's samples after the wrapper's last one, and what the job reported
                attempt.peak_used_mib = daemon_peak
            self._classify(attempt, limit)  # again, with migd's last samples
            attempt_peak = self._peak_of(attempt, limit)
            if attempt_peak is not None and attempt_peak > peak:
                # the most GPU memory the job used (or asked for when it ran out) on any
                # attempt: what to ask for next time
                peak = attempt_peak
                # HTCondor's own GPUsMemoryUsage ("peak memory usage over the lifetime of
                # the job, in megabytes", managing-a-job.rst) is filled by its GPU monitor,
                # which migd nodes do not run (it misreports shared GPUs): feed it the
                # job's own peak instead.
                self._chirp({"MigdPeakMB": peak, "GPUsMemoryUsage": peak})
            if attempt.stopped or self.stop_signal is not None:
                return self._finish(attempt)
            if attempt.taken_back is None and self._checkpointed(attempt):
                # HTCondor restarts the job from its checkpoint (the starter runs this
                # wrapper again): never an out-of-memory failure, whatever its stderr
                # says, and the next run asks for at least this partition.
                self._chirp({"MigdCheckpointVRAM": max(limit, memory)})
                self.say(
                    f"the job exited to checkpoint ({self._end_text(attempt)}); the run "
                    f"after it asks for at least {max(limit, memory)} MiB"
                )
                return self._finish(attempt)
            plan = attempt.taken_back or self._stop_plan()
            if attempt.taken_back is not None or (
                attempt.exit_code != 0 and plan.observe(released)
            ):
                # migd took the lease back (and the wrapper stopped the job), or the job
                # failed on a lease already taken back (its GPU died under it before the
                # wrapper's next look): its exit status is migd's doing, not the job's.
                # A job that finished with 0 before the wrapper heard keeps its result.
                raise self._lease_lost(lease, plan)
            oom = attempt.oom
            if oom is not None and oom.kind == "mps_unavailable":
                # The matched stderr line goes to the MPS manager, which restarts a daemon
                # whose server stopped taking clients (docs/api.md, MPS leases).
                self._report(
                    lease,
                    "mps_client_error",
                    attempt,
                    None,
                    message=oom.matched or f"{oom.signature}: {oom.reason}",
                )
                raise WrapperFailure(
                    f"migd: the job could not use its MPS share on GPU {lease.get('gpu')} "
                    f"({oom.signature}: {oom.reason}); migd was told, HTCondor runs it again"
                )
            if attempt.forecast is not None:
                fc = attempt.forecast
                reason = (
                    f"the memory forecast says the job needs ~{int(fc.predicted_peak_mib)} MiB "
                    f"(up to {int(fc.upper_mib)}) by step {fc.at_step:.0f} but the partition "
                    f"has {limit} MiB"
                )
                # Size on the point forecast ([MIG-HT]: "the slice that meets the memory
                # requirement"): early in a run the upper band is several times the real
                # peak. If that was too little, the OOM path takes over.
                needed: float | None = self.settings.forecast.needed_mib(fc.predicted_peak_mib)
                event = "forecast"
            elif oom is not None and oom.is_oom:
                if oom.kind == "weak":
                    if weak_restarts >= self.settings.oom.weak_retries:
                        self.say(
                            f"the job failed again on weak out-of-memory evidence ({oom.reason}); "
                            f"{self.settings.oom.weak_retries} bigger retry allowed: passing "
                            "its exit status through"
                        )
                        return self._finish(attempt)
                    weak_restarts += 1
                where = self.leases.where(lease)
                reason = f"the job ran out of GPU memory on {where} ({oom.reason})"
                needed = None
                if oom.tried_mib and attempt.peak_used_mib:
                    needed = attempt.peak_used_mib + oom.tried_mib
                event = "oom"
            else:
                if oom is not None:
                    self.debug(f"exit classified as {oom.kind}: {oom.reason}")
                return self._finish(attempt)
            size = self._restart_size(lease, limit, needed)
            restarts += 1
            self._report(lease, event, attempt, size, peak=attempt_peak)
            if size.request_mib is None:
                self.say(f"{reason}; {size.reason}")
                return self._give_up(limit, size.wanted_mib, "nothing bigger on this node")
            if restarts > spec.max_restarts:
                self.say(f"{reason}; no restarts left ({spec.max_restarts} allowed)")
                return self._give_up(limit, size.wanted_mib, "restart limit reached")
            self.say(
                f"{reason}; restarting on "
                + ("the largest partition here" if size.capped else "a bigger partition")
                + f" ({size.reason}; restart {restarts} of {spec.max_restarts})"
            )
            self._chirp({"RequestVRAM": size.request_mib})
            memory = size.request_mib

    def _resume_size(self, memory: int) -> int:
        """The size to ask for first: the request, or the partition the job held at its
        last checkpoint if that is larger (the job resumes with the state it saved)."""
        if not self.spec.checkpoints:
            return memory
        remembered = self.spec.checkpoint_vram
        if self.spec.under_condor and self.spec.want_chirp and self.get_job_attr is not None:
            # The sandbox's job ad is the one this claim started with: ask the shadow
            # for what the checkpoint exit before this run chirped.
            try:
                value = self.get_job_attr("MigdCheckpointVRAM")
            except MigdError as exc:
                self.debug(f"cannot read MigdCheckpointVRAM: {exc.message}")
                value = None
            if value is not None and value.strip().isdigit():
                remembered = max(remembered, int(value))
        if remembered > memory:
            self.say(
                f"resuming from a checkpoint taken on a {remembered} MiB partition: "
                f"asking for at least that (request {memory} MiB)"
            )
            self._chirped["MigdCheckpointVRAM"] = remembered
            return remembered
        return memory

    def _checkpointed(self, attempt: Attempt) -> bool:
        spec = self.spec
        if spec.checkpoint_exit_signal is not None:
            return attempt.signum == spec.checkpoint_exit_signal
        return spec.checkpoint_exit_code is not None and (
            attempt.exit_code == spec.checkpoint_exit_code
        )

    @staticmethod
    def _end_text(attempt: Attempt) -> str:
        if attempt.signum is not None:
            return f"signal {signal.Signals(attempt.signum).name}"
        return f"exit code {attempt.exit_code}"

    def _classify(self, attempt: Attempt, limit: int) -> None:
        if attempt.forecast is not None:
            return
        oom = attempt.oom = classify_exit(
            attempt.exit_code,
            attempt.signum,
            attempt.tail,
            attempt.peak_used_mib,
            limit,
            policy=self.settings.oom,
        )
        if oom.is_oom and oom.held_mib is not None:
            # What the job held at the failure is usage, whatever the samples missed.
            attempt.peak_used_mib = max(attempt.peak_used_mib or 0, math.ceil(oom.held_mib))

    @staticmethod
    def _peak_of(attempt: Attempt, limit: int) -> int | None:
        """The attempt's peak for MigdPeakMB and migd's history: the largest of what was
        measured (the wrapper's and migd's samples, the job's own report, what the OOM
        message says it held) and, when it ran out of memory, what it asked for (that
        plus the failed allocation), else the partition it filled (a strong OOM with no
        figure at all). ``None``: nothing known."""
        used = attempt.peak_used_mib  # (it includes what the OOM message says was held)
        values = [used]
        oom = attempt.oom
        if oom is not None and oom.is_oom:
            if oom.tried_mib is not None and used is not None:
                # what it asked for: as restart sizing reckons it (RequestVRAM)
                values.append(math.ceil(used + oom.tried_mib))
            elif used is None and oom.kind == "strong":
                values.append(limit)
        known = [v for v in values if v is not None]
        return max(known) if known else None

    def _restart_size(self, lease: dict[str, Any], limit: int, needed: float | None) -> RestartSize:
        return restart_size(
            limit,
            ladder=lease.get("mode") == "mig",
            largest_mib=self.leases.largest_here(),
            needed_mib=needed,
            growth_factor=self.spec.growth_factor,
        )

    def _stop_plan(self) -> StopPlan:
        return StopPlan(kill_sig=self.spec.kill_sig, grace_s=self.settings.section.term_grace_s)

    def _lease_lost(self, lease: dict[str, Any], plan: StopPlan) -> WrapperFailure:
        """The failure that has HTCondor run the job again, with migd's reason.

        Exit 85 with the wrapper error file: the starter evicts the job back to Idle
        (not held, docs/htcondor-notes.md (c)) with the reason as ``VacateReason``;
        should the file be missed, the access-point config requeues an exit 85 that
        ``MigdLeaseLost`` marks, and holds a job that lost its lease too often.
        """
        reason = plan.reason
        assert reason is not None
        uuid = lease.get("gpu_uuid") or ""
        what = plan.message()
        attrs: dict[str, str | int | bool] = {
            "MigdLeaseLost": True,
            "MigdLeaseLosses": self.spec.lease_losses + 1,
            "MigdLeaseEndReason": reason.value,
            "MigdLeaseLostReason": what[:500],
        }
        again = "to run again"
        if reason is LeaseEndReason.GPU_LOST:
            # Also under the names of earlier versions (ads, the rerun's own checks).
            attrs["MigdGpuLosses"] = self.spec.gpu_losses + 1
            attrs["MigdGpuLostReason"] = what[:500]
            again = "to run on a healthy GPU"
        self._chirp(attrs)
        return WrapperFailure(
            f"migd: {what} (lease {lease.get('lease_id')}"
            + (f", GPU {uuid}" if uuid else "")
            + f"); the job was stopped and goes back to the queue {again}",
            exit_code=LEASE_LOST_EXIT_CODE,
            start_failure=False,
        )

    def _stop(self, child: subprocess.Popen[bytes], plan: StopPlan) -> int:
        """Stop the job as ``plan`` says: its kill signal, then SIGKILL after the grace
        period; then whatever of its process group is left (the partition is no longer
        the job's: nothing of it may stay on the GPU). Returns the job's status."""
        while True:
            sig = plan.step(time.monotonic(), child.poll() is None)
            if sig is not None:
                self.debug(f"sending {signal.Signals(sig).name} to the job's process group")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, sig)
            wait = plan.wait_s(time.monotonic())
            try:
                returncode = child.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        return returncode

    def _finish(self, attempt: Attempt) -> int:
        if attempt.signum is not None:
            self.reraise(attempt.signum)
        if self.stop_signal is not None and attempt.exit_code is None:
            self.reraise(self.stop_signal)  # stopped before the job ran
        return attempt.exit_code if attempt.exit_code is not None else 1

    def _give_up(self, limit: int, wanted: int, why: str) -> int:
        self._chirp(
            {
                "RequestVRAM": wanted,
                "MigdLastVRAM": limit,
                "MigdOomExits": self.spec.oom_exits + 1,
                "MigdOomExit": True,
            }
        )
        self.say(
            f"giving up on this node ({why}); exiting with {OOM_EXIT_CODE} so HTCondor can "
            f"run the job again with request_VRAM >= {wanted} MiB"
        )
        return OOM_EXIT_CODE

    def _chirp(self, attrs: Mapping[str, str | int | bool]) -> None:
        """Update the job ad (only under HTCondor with an IO proxy); never raises."""
        if not (self.spec.under_condor and self.spec.want_chirp and self.set_job_attrs):
            return
        todo = {k: v for k, v in attrs.items() if self._chirped.get(k) != v}
        if not todo:
            return
        try:
            how = self.set_job_attrs(todo)
        except MigdError as exc:
            self.say(f"could not update {', '.join(todo)}: {exc.message}")
            return
        self._chirped.update(todo)
        if "RequestVRAM" in todo:
            self.say(f"updated the job's RequestVRAM to {todo['RequestVRAM']} MiB ({how})")
        self.debug(f"job ad: {', '.join(f'{k} = {v}' for k, v in todo.items())} ({how})")

    # -- lease ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _interruptible_wait(self) -> Iterator[None]:
        """A wait for a lease, which a stop signal cuts short (StopRequested)."""
        self._interruptible = True
        try:
            if self.stop_signal is not None:
                raise StopRequested(self.stop_signal)
            yield
        finally:
            self._interruptible = False

    def _report(
        self,
        lease: dict[str, Any],
        event: str,
        attempt: Attempt,
        size: RestartSize | None,
        message: str | None = None,
        *,
        peak: int | None = None,
    ) -> None:
        data: dict[str, Any] = {"peak_used_mib": attempt.peak_used_mib if peak is None else peak}
        if event == "exit":
            data["exit_code"], data["signal"] = attempt.exit_code, attempt.signum
        if message is not None:
            data["message"] = message
        if size is not None:
            data["next_request_mib"] = size.request_mib
            data["wanted_mib"] = size.wanted_mib
        if attempt.oom is not None:
            data["oom"] = attempt.oom.to_dict()
        if attempt.forecast is not None:
            data["forecast"] = attempt.forecast.to_dict()
            data["forecast"]["step"] = attempt.forecast_step
        with contextlib.suppress(MigdError):
            self.client.call("report", lease_id=lease["lease_id"], event=event, data=data)

    # -- one attempt ------------------------------------------------------------------------

    def _environment(self, lease: dict[str, Any], memstats: Path | None) -> dict[str, str]:
        env = dict(os.environ)
        extra = dict(lease.get("env") or {})
        extra["MIGD_LEASE_ID"] = lease["lease_id"]
        if lease.get("group"):
            extra["MIGD_LEASE_IDS"] = ",".join(m["lease_id"] for m in members(lease))
        extra["MIGD_GPU_MEMORY_LIMIT_MIB"] = str(lease.get("memory_limit_mib") or "")
        if memstats is not None:
            extra["MIGD_MEMSTATS_FILE"] = str(memstats)
            # Pre-allocating frameworks hide their growth from NVML; the forecast needs it.
            env.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        for key, value in extra.items():
            env[key] = value
            # Apptainer/Singularity jobs: the starter runs the container with a clean
            # environment and passes *ENV_ variables in; the wrapper runs outside it.
            for prefix in ENV_TWINS:
                env[prefix + key] = value
        # For the container runtime itself, outside the container (migd/wrapper/containers.py).
        env.update(container_env(self.spec.command, env, extra))
        return env

    def _start(self, env: dict[str, str]) -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(
                list(self.spec.command), env=env, stderr=subprocess.PIPE, process_group=0
            )
        except OSError as exc:
            # The job's own problem (a typo in `executable`, no +x): fail it like a shell
            # would, not as a migd failure that HTCondor would retry forever.
            code = 127 if exc.errno == errno.ENOENT else 126
            raise _JobNotStarted(
                f"cannot start the job {self.spec.command[0]!r}: {exc.strerror or exc}; "
                f"exiting with {code}",
                code,
            ) from exc

    def _supervise(self, lease: dict[str, Any]) -> Attempt:
        attempt = Attempt(lease)
        if self.stop_signal is not None:
            attempt.stopped = True  # stopped between the grant and the start
            return attempt
        options = self.settings.section
        limit = lease.get("memory_limit_mib")
        memstats = None
        if self.spec.early_restart:
            base = Path(os.environ.get("_CONDOR_SCRATCH_DIR") or os.environ.get("TMPDIR") or "/tmp")
            memstats = base / f".migd-memstats-{os.getpid()}-{lease['lease_id']}.jsonl"
            with contextlib.suppress(OSError):
                memstats.unlink()
        tail = TailBuffer()
        plan = self._stop_plan()
        ns_status = pid_ns_status_path() if self.pid_ns_init else None
        if ns_status is not None:
            # condor_pid_ns_init removes it too, but not if it never runs: an earlier
            # attempt's end must not pass for this one's.
            with contextlib.suppress(OSError):
                ns_status.unlink()
        child = self.child = self._start(self._environment(lease, memstats))
        assert child.stderr is not None
        pump = threading.Thread(target=self._pump, args=(child.stderr, tail), daemon=True)
        pump.start()
        # Two series, never mixed: NVML samples keyed by seconds since the start while
        # the job reports nothing, then, from its first MIGD_MEMSTATS_FILE line, a fresh
        # forecaster keyed by the job's own iterations. The NVML series starts late:
        # start-up (context, model loading) is a steep climb that says nothing about growth.
        by_time = None
        if self.spec.early_restart:
            by_time = Forecaster(
                dataclasses.replace(
                    self.settings.forecast, warmup_steps=options.forecast_time_warmup_s
                )
            )
        by_step: Forecaster | None = None
        started = time.monotonic()
        last_logged = -float("inf")
        memstats_offset = 0
        samples = 0
        while True:
            interval = options.sample_interval_s
            if samples < len(EARLY_SAMPLES_S):
                interval = min(interval, EARLY_SAMPLES_S[samples])
            try:
                returncode = child.wait(timeout=interval)
                break
            except subprocess.TimeoutExpired:
                pass
            samples += 1
            view = self.leases.view(lease)
            if view is not None and self.stop_signal is None and plan.observe(view):
                # migd took the lease back (an admin, expiry, the instance or the GPU
                # gone): another job may get the partition, so this one stops now.
                attempt.taken_back = plan
                self.say(
                    f"{plan.message()}; stopping the job "
                    f"({signal.Signals(plan.kill_sig).name}, SIGKILL after {plan.grace_s:g} s)"
                )
                returncode = self._stop(child, plan)
                break
            usage = self.leases.usage(lease, child.pid)
            if usage is not None:
                attempt.peak_used_mib = max(attempt.peak_used_mib or 0, usage)
            if by_time is None or not limit or self.stop_signal is not None:
                continue
            if by_step is None and self._memstats_ready(memstats, memstats_offset):
                by_step = Forecaster(self.settings.forecast)
                self.debug("the job reports allocator statistics: forecasting per iteration")
            if by_step is not None:
                memstats_offset = self._feed_memstats(by_step, memstats, memstats_offset)
                forecaster = by_step
            else:
                if usage is not None:
                    by_time.add(time.monotonic() - started, used_mib=usage)
                forecaster = by_time
            verdict = forecaster.verdict(float(limit), self.spec.horizon)
            if verdict.fire:
                attempt.forecast = verdict
                attempt.forecast_step = forecaster.last_step
                self.say(f"forecast: {verdict.reason}")
                self._terminate(child)
                returncode = child.wait()
                break
            now = time.monotonic()
            if self.settings.debug and now - last_logged >= options.decision_log_interval_s:
                last_logged = now
                self.debug(
                    f"forecast at step {forecaster.last_step}: {verdict.reason} "
                    f"(slope {verdict.slope:.2f} MiB/step, sigma {verdict.sigma:.0f} MiB, "
                    f"n {verdict.n})"
                )
        pump.join(timeout=5)
        if not pump.is_alive():  # (a grandchild may still hold the pipe open)
            child.stderr.close()
        self.child = None
        if memstats is not None:
            with contextlib.suppress(OSError):
                memstats.unlink()
        # condor_pid_ns_init exits 0 for a job killed by a signal: its file has the truth.
        end = read_pid_ns_status(ns_status) or JobEnd.from_returncode(returncode)
        attempt.signum, attempt.exit_code = end.signum, end.exit_code
        attempt.stopped = self.stop_signal is not None
        attempt.tail = tail.data
        return attempt

    def _pump(self, stream: IO[bytes], tail: TailBuffer) -> None:
        out = self.err
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                break
            tail.feed(chunk)
            with contextlib.suppress(OSError, ValueError):
                out.write(chunk)
                out.flush()

    @staticmethod
    def _memstats_ready(path: Path | None, offset: int) -> bool:
        try:
            return path is not None and path.stat().st_size > offset
        except OSError:
            return False

    def _feed_memstats(self, forecaster: Forecaster, path: Path | None, offset: int) -> int:
        """Read the job's allocator statistics (one JSON object per line) since ``offset``."""
        if path is None:
            return offset
        try:
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return offset
        end = data.rfind(b"\n")
        if end < 0:
            return offset
        for line in data[: end + 1].splitlines():
            try:
                row = json.loads(line)
                forecaster.observe(
                    MemorySample(
                        step=float(row["step"]),
                        used_mib=row.get("used_mib"),
                        allocated_mib=row.get("allocated_mib"),
                        reserved_mib=row.get("reserved_mib"),
                        requested_mib=row.get("requested_mib"),
                        reuse_ratio=row.get("reuse_ratio"),
                    )
                )
            except (ValueError, KeyError, TypeError):
                continue  # a torn or foreign line is not the wrapper's problem
        return offset + end + 1

    def _terminate(self, child: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=self.settings.section.term_grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
