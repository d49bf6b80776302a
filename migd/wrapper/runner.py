"""Run one job on a migd partition: lease, supervise, detect OOM, restart bigger, release.

The job runs as a child in its own process group; every signal HTCondor sends
(SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2) is forwarded to that group.
Its stderr is teed to ours (the job's error file) through a ring buffer that
the OOM classifier reads. Exit: the job's exit code, or its signal re-raised on
ourselves, so HTCondor records what the job did. The lease is released on every
path; if we are SIGKILLed, the JOB_EXIT hook and then migd's reaper release it.

Exit codes of our own (documented in docs/wrapper.md):

* 86 (``OOM_EXIT_CODE``): the job ran out of GPU memory and no bigger partition
  is available on this node; ``RequestVRAM`` was raised through chirp so
  HTCondor can re-match it (``condor_config/20-migd-schedd.conf`` holds it at
  the largest size).
* 1 with ``$_CONDOR_WRAPPER_ERROR_FILE`` written: migd could not serve the job
  (daemon down, request impossible); HTCondor shows the reason.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from migd.client import MigdClient
from migd.core.forecast import Forecaster, ForecastPolicy, MemorySample, Verdict
from migd.core.oom import OomPolicy, OomVerdict, TailBuffer, classify_exit
from migd.errors import (
    DaemonUnavailable,
    LeaseTimeout,
    MigdError,
    NoCapacity,
    RequestTooLarge,
)
from migd.wrapper.jobspec import JobSpec

OOM_EXIT_CODE = 86
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# Signals that mean "HTCondor is stopping this job": never restart after those.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
ENV_TWINS = ("APPTAINERENV_", "SINGULARITYENV_")


class WrapperFailure(Exception):
    """migd could not serve the job; ``message`` is the one line HTCondor should show."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class StopRequested(Exception):
    """A stop signal arrived while no job was running (e.g. while waiting for a lease)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Attempt:
    lease: dict[str, Any]
    exit_code: int | None = None
    signum: int | None = None
    peak_used_mib: int | None = None
    oom: OomVerdict | None = None
    forecast: Verdict | None = None
    stopped: bool = False  # a stop signal came from outside


@dataclass
class RunnerOptions:
    sample_interval_s: float = 2.0
    term_grace_s: float = 10.0
    memstats_dir: Path | None = None
    forecast: ForecastPolicy = field(default_factory=ForecastPolicy)
    oom: OomPolicy = field(default_factory=OomPolicy)
    restart_wait_s: float = 600.0


class JobRunner:
    def __init__(
        self,
        spec: JobSpec,
        client: MigdClient,
        *,
        options: RunnerOptions | None = None,
        set_job_attr: Callable[[str, str | int], str] | None = None,
        err: IO[bytes] | None = None,
    ) -> None:
        self.spec = spec
        self.client = client
        self.options = options or RunnerOptions()
        self.set_job_attr = set_job_attr
        self.err = err or sys.stderr.buffer
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_signal: int | None = None
        self._old_handlers: dict[int, Any] = {}

    # -- messages ---------------------------------------------------------------------------

    def say(self, message: str) -> None:
        """One line on the job's stderr, so the user sees what migd did."""
        with contextlib.suppress(OSError, ValueError):
            self.err.write(f"[migd] {message}\n".encode())
            self.err.flush()

    # -- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        del frame
        if signum in STOP_SIGNALS:
            self.stop_signal = signum
        child = self.child
        if child is not None and child.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signum)
        elif signum in STOP_SIGNALS:
            raise StopRequested(signum)

    def _install_handlers(self) -> None:
        for sig in FORWARDED_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)

    # -- the whole run ----------------------------------------------------------------------

    def run(self) -> int:
        """Run the job to completion (with restarts); the exit code to return.

        Raises:
            WrapperFailure: migd could not give the job a partition.
            StopRequested: HTCondor stopped us before the job ran.
        """
        self._install_handlers()
        try:
            return self._run()
        finally:
            self._restore_handlers()

    def _run(self) -> int:
        spec = self.spec
        memory = spec.memory_mib
        restarts = 0
        while True:
            lease = self._acquire(memory, first=restarts == 0)
            try:
                attempt = self._supervise(lease)
            finally:
                self._release(lease, "job attempt ended")
            limit = int(lease.get("memory_limit_mib") or memory)
            if attempt.stopped or self.stop_signal is not None:
                return self._finish(attempt)
            reason = None
            fallback: int | None = None
            if attempt.forecast is not None:
                fc = attempt.forecast
                reason = (
                    f"the memory forecast says the job needs ~{int(fc.predicted_peak_mib)} MiB "
                    f"(up to {int(fc.upper_mib)}) by step {fc.at_step:.0f} but the partition "
                    f"has {limit} MiB"
                )
                # Size on the point forecast (seed 002: "the slice that meets the memory
                # requirement"): early in a run the upper band is several times the real
                # peak. If the forecast still asks too much, the next profile up is tried.
                want = max(limit + 1, self.options.forecast.needed_mib(fc.predicted_peak_mib))
                fallback = limit + 1
            elif attempt.oom is not None and attempt.oom.is_oom:
                reason = (
                    f"the job ran out of GPU memory on {self._where(lease)} ({attempt.oom.reason})"
                )
                want = self._bigger(limit, attempt)
            else:
                return self._finish(attempt)
            restarts += 1
            self._report(lease, "oom" if attempt.forecast is None else "forecast", attempt, want)
            if restarts > spec.max_restarts:
                self.say(f"{reason}; no restarts left ({spec.max_restarts} allowed)")
                return self._give_up(want, "restart limit reached")
            self.say(
                f"{reason}; restarting on a bigger partition "
                f"(>= {want} MiB, restart {restarts} of {spec.max_restarts})"
            )
            self._chirp_request(want)
            memory = want
            if fallback is not None and fallback < want:
                memory = self._fits_here(want, fallback)

    def _fits_here(self, want: int, fallback: int) -> int:
        """``want`` if this node has a partition that big, else ``fallback``."""
        try:
            status = self.client.status()
        except MigdError:
            return want
        largest = max(
            (
                max(p["memory_mib"] for p in gpu.get("instances", []) or [{"memory_mib": 0}])
                for gpu in status.get("gpus", [])
            ),
            default=0,
        )
        largest = max(
            [largest]
            + [int(g.get("full_profile_mib") or 0) for g in status.get("gpus", [])]
            + [
                int(g.get("memory_total_mib") or 0)
                for g in status.get("gpus", [])
                if g.get("mode") != "mig"
            ]
        )
        if want <= largest:
            return want
        self.say(f"no partition of {want} MiB on this node; trying the next size up instead")
        return fallback

    def _where(self, lease: dict[str, Any]) -> str:
        if lease.get("profile"):
            return (
                f"{lease['profile']} ({lease.get('memory_limit_mib')} MiB, GPU {lease.get('gpu')})"
            )
        return f"an MPS share of {lease.get('memory_limit_mib')} MiB on GPU {lease.get('gpu')}"

    def _bigger(self, limit: int, attempt: Attempt) -> int:
        want = limit + 1  # migd right-sizes this to the next MIG profile up
        growth = self.spec.growth_factor
        if growth <= 0 and attempt.lease.get("mode") != "mig":
            growth = 2.0  # an MPS share or a whole GPU has no profile ladder: double it
        if growth > 0:
            want = max(want, math.ceil(limit * growth))
        oom = attempt.oom
        if oom is not None and oom.tried_mib and attempt.peak_used_mib:
            want = max(want, math.ceil(attempt.peak_used_mib + oom.tried_mib))
        return want

    def _finish(self, attempt: Attempt) -> int:
        if attempt.signum is not None:
            self._reraise(attempt.signum)
        return attempt.exit_code if attempt.exit_code is not None else 1

    def _reraise(self, signum: int) -> None:
        """Die of the job's signal so HTCondor records ExitBySignal like the job's."""
        self._restore_handlers()
        sys.stdout.flush()
        with contextlib.suppress(OSError, ValueError):
            self.err.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the signal is delivered before this returns
        raise SystemExit(128 + signum)

    def _give_up(self, want: int, why: str) -> int:
        self._chirp_request(want)
        self.say(
            f"giving up on this node ({why}); exiting with {OOM_EXIT_CODE} so HTCondor can "
            f"run the job again with request_VRAM >= {want} MiB"
        )
        return OOM_EXIT_CODE

    def _chirp_request(self, want: int) -> None:
        if not (self.spec.under_condor and self.spec.want_chirp and self.set_job_attr):
            return
        try:
            how = self.set_job_attr("RequestVRAM", want)
            self.say(f"updated the job's RequestVRAM to {want} MiB ({how})")
        except MigdError as exc:
            self.say(f"could not update RequestVRAM: {exc.message}")

    # -- lease ------------------------------------------------------------------------------

    def _acquire(self, memory: int, *, first: bool) -> dict[str, Any]:
        spec = self.spec
        wait = spec.wait_s if first else (spec.wait_s or self.options.restart_wait_s)
        try:
            lease: dict[str, Any] = self.client.lease(
                job_id=spec.job_id,
                slot=spec.slot or None,
                gpu_memory_mib=memory,
                min_compute=spec.min_compute or None,
                mode=spec.mode,
                gpus=list(spec.gpus) if spec.gpus else None,
                wait_s=wait,
                holder_pid=os.getpid(),
            )
        except RequestTooLarge as exc:
            if first:
                raise WrapperFailure(
                    f"migd: {exc.message} (hint: {exc.hint})", exit_code=1
                ) from exc
            raise WrapperFailure(self._no_bigger(memory, exc.message), OOM_EXIT_CODE) from exc
        except (LeaseTimeout, NoCapacity) as exc:
            if first:
                raise WrapperFailure(f"migd: no GPU partition became free: {exc.message}") from exc
            raise WrapperFailure(self._no_bigger(memory, exc.message), OOM_EXIT_CODE) from exc
        except DaemonUnavailable as exc:
            raise WrapperFailure(
                f"migd is not available: {exc.message} (hint: {exc.hint})"
            ) from exc
        except MigdError as exc:
            raise WrapperFailure(f"migd refused the job: {exc.message}") from exc
        decision = lease.get("decision") or {}
        self.say(
            f"lease {lease['lease_id']}: {self._where(lease)}"
            + (f"; {decision['reason']}" if decision.get("reason") else "")
        )
        return lease

    def _no_bigger(self, memory: int, why: str) -> str:
        self._chirp_request(memory)
        self.say(f"no partition of >= {memory} MiB on this node: {why}")
        return f"migd: the job needs >= {memory} MiB of GPU memory; not available on this node"

    def _release(self, lease: dict[str, Any], reason: str) -> None:
        try:
            self.client.release(lease["lease_id"], reason=reason)
        except MigdError as exc:
            # The JOB_EXIT hook and migd's reaper release it if we cannot.
            self.say(f"could not release lease {lease['lease_id']}: {exc.message}")

    def _report(self, lease: dict[str, Any], event: str, attempt: Attempt, want: int) -> None:
        data: dict[str, Any] = {"next_request_mib": want, "peak_used_mib": attempt.peak_used_mib}
        if attempt.oom is not None:
            data["oom"] = attempt.oom.to_dict()
        if attempt.forecast is not None:
            data["forecast"] = attempt.forecast.to_dict()
        with contextlib.suppress(MigdError):
            self.client.call("report", lease_id=lease["lease_id"], event=event, data=data)

    # -- one attempt ------------------------------------------------------------------------

    def _environment(self, lease: dict[str, Any], memstats: Path | None) -> dict[str, str]:
        env = dict(os.environ)
        extra = dict(lease.get("env") or {})
        extra["MIGD_LEASE_ID"] = lease["lease_id"]
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
        return env

    def _supervise(self, lease: dict[str, Any]) -> Attempt:
        attempt = Attempt(lease)
        limit = lease.get("memory_limit_mib")
        memstats = None
        if self.spec.early_restart:
            base = self.options.memstats_dir or Path(
                os.environ.get("_CONDOR_SCRATCH_DIR") or os.environ.get("TMPDIR") or "/tmp"
            )
            memstats = base / f".migd-memstats-{os.getpid()}-{lease['lease_id']}.jsonl"
            with contextlib.suppress(OSError):
                memstats.unlink()
        env = self._environment(lease, memstats)
        tail = TailBuffer()
        try:
            self.child = subprocess.Popen(
                list(self.spec.command), env=env, stderr=subprocess.PIPE, process_group=0
            )
        except OSError as exc:
            raise WrapperFailure(f"cannot start the job {self.spec.command[0]}: {exc}") from exc
        child = self.child
        assert child.stderr is not None
        pump = threading.Thread(target=self._pump, args=(child.stderr, tail), daemon=True)
        pump.start()
        forecaster = Forecaster(self.options.forecast) if self.spec.early_restart else None
        started = time.monotonic()
        memstats_offset = 0
        job_reports = False  # the job writes allocator statistics to MIGD_MEMSTATS_FILE
        while True:
            try:
                returncode = child.wait(timeout=self.options.sample_interval_s)
                break
            except subprocess.TimeoutExpired:
                pass
            usage = self._usage(lease)
            if usage is not None:
                attempt.peak_used_mib = max(attempt.peak_used_mib or 0, usage)
            if forecaster is None or not limit or self.stop_signal is not None:
                continue
            new_offset = self._feed_memstats(forecaster, memstats, memstats_offset)
            job_reports = job_reports or new_offset > 0
            memstats_offset = new_offset
            if not job_reports and usage is not None:
                # The job reports nothing: forecast NVML's view per second of run time.
                forecaster.add(time.monotonic() - started, used_mib=usage)
            verdict = forecaster.verdict(float(limit), self.spec.horizon)
            if verdict.fire:
                attempt.forecast = verdict
                self.say(f"forecast: {verdict.reason}")
                self._terminate(child)
                returncode = child.wait()
                break
        pump.join(timeout=5)
        self.child = None
        if memstats is not None:
            with contextlib.suppress(OSError):
                memstats.unlink()
        if returncode < 0:
            attempt.signum = -returncode
        else:
            attempt.exit_code = returncode
        attempt.stopped = self.stop_signal is not None
        if attempt.forecast is None and not attempt.stopped:
            attempt.oom = classify_exit(
                attempt.exit_code,
                attempt.signum,
                tail.data,
                attempt.peak_used_mib,
                int(limit) if limit else None,
                policy=self.options.oom,
            )
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

    def _usage(self, lease: dict[str, Any]) -> int | None:
        try:
            usage = self.client.call("usage", lease_id=lease["lease_id"], timeout_s=10.0)
        except MigdError:
            return None
        procs = usage.get("processes") or []
        known = [p["used_mib"] for p in procs if p.get("used_mib") is not None]
        if known:
            return int(sum(known))
        used = usage.get("device_used_mib")
        return int(used) if used is not None and lease.get("mode") == "mig" else None

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
            child.wait(timeout=self.options.term_grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
