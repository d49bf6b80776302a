"""The wrapper's side of the job's lease(s): ask migd, watch, sample, release.

What the runner (:mod:`migd.wrapper.runner`) asks of migd about the partitions a job
holds: the lease itself (waiting inside migd, with the wait notice), the lease as migd
sees it now (has it been taken back?), the job's memory on it, the largest partition
this node could give (restart sizing), and the release. A multi-GPU job holds a group
of leases (:func:`members`); each call covers every member. Failures are
:class:`WrapperFailure` (the one line HTCondor shows) or, for a restart,
:class:`NoBigger`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from migd.client import MigdClient
from migd.errors import (
    DaemonUnavailable,
    LeaseTimeout,
    MigdError,
    NoCapacity,
    ProtocolError,
    RequestTooLarge,
)
from migd.wrapper.cgroup import own_cgroup
from migd.wrapper.jobspec import JobSpec
from migd.wrapper.settings import WrapperSettings
from migd.wrapper.wait_notice import WaitNotice, wait_reason


class WrapperFailure(Exception):
    """migd could not serve the job; ``message`` is the one line HTCondor should show.

    ``start_failure``: counted in ``MigdStartFailures`` (the access point holds a job
    migd keeps failing to start); a GPU that failed under a running job is not.
    """

    def __init__(self, message: str, exit_code: int = 1, *, start_failure: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.start_failure = start_failure


class NoBigger(Exception):
    """A restart found nothing bigger on this node (the daemon refused or timed out)."""


class JobLeases:
    """The job's leases as the wrapper sees them (see the module docstring).

    ``say``, ``debug`` and ``chirp`` are the runner's: a line on the job's stderr, one
    only with debug on, and job-ad attributes through chirp (never raises).
    """

    def __init__(
        self,
        spec: JobSpec,
        client: MigdClient,
        settings: WrapperSettings,
        *,
        say: Callable[[str], None],
        debug: Callable[[str], None],
        chirp: Callable[[Mapping[str, str | int | bool]], None],
    ) -> None:
        self.spec = spec
        self.client = client
        self.settings = settings
        self.say = say
        self.debug = debug
        self.chirp = chirp

    def acquire(
        self,
        memory: int,
        *,
        first: bool,
        interruptible: Callable[[], AbstractContextManager[None]] = nullcontext,
    ) -> dict[str, Any]:
        """Lease a partition of ``memory`` MiB (every GPU of a multi-GPU job), waiting
        inside migd; ``first``: the job's first lease on this node, not a restart.
        ``interruptible``: the stretch a stop signal may cut short (the runner's).

        Raises:
            WrapperFailure: migd cannot serve the job (its message says why).
            NoBigger: a restart found nothing of ``memory`` MiB on this node.
        """
        spec = self.spec
        wait = spec.wait_s if first else (spec.wait_s or self.settings.section.restart_wait_s)
        with interruptible():
            try:
                fields: dict[str, Any] = {
                    "job_id": spec.job_id,
                    "slot": spec.slot or None,
                    "gpu_memory_mib": memory,  # memory_mib's wire name (migd.api.LeaseRequestMsg)
                    "min_compute": spec.min_compute or None,
                    "mode": spec.mode,
                    "gpus": list(spec.gpus) if spec.gpus else None,
                    "wait_s": wait,
                    # Sent only for several GPUs: a one-GPU request stays what older daemons
                    # take (docs/api.md, "Several GPUs per job").
                    "gpu_count": spec.gpu_count if spec.gpu_count > 1 else None,
                }
                cgroup = own_cgroup()
                notice = WaitNotice(
                    self.settings.section.wait_notice_s,
                    lambda since: self._announce_wait(since, memory),
                )
                with notice:
                    try:
                        lease: dict[str, Any] = self.client.lease(**fields, cgroup=cgroup)
                    except ProtocolError as exc:
                        if "gpu_count" in exc.message:
                            raise WrapperFailure(
                                f"migd on this node is too old to give a job {spec.gpu_count} "
                                f"GPUs ({exc.message}); upgrade migd, or ask for one GPU"
                            ) from exc
                        # A daemon older than the field refuses it as unknown (a package
                        # upgrade replaces this wrapper before migd restarts): ask again
                        # without it; the per-process MPS limit still holds.
                        if cgroup is None or "cgroup" not in exc.message:
                            raise
                        self.debug("migd does not take the job's cgroup yet; asking without it")
                        lease = self.client.lease(**fields)
            except RequestTooLarge as exc:
                if first:
                    raise WrapperFailure(
                        f"migd: {exc.message} (hint: {exc.hint})", exit_code=1
                    ) from exc
                raise NoBigger(
                    f"no partition of >= {memory} MiB on this node: {exc.message}"
                ) from exc
            except (LeaseTimeout, NoCapacity) as exc:
                if first:
                    raise WrapperFailure(
                        f"migd: no GPU partition became free: {exc.message}"
                    ) from exc
                raise NoBigger(
                    f"no partition of >= {memory} MiB became free: {exc.message}"
                ) from exc
            except DaemonUnavailable as exc:
                raise WrapperFailure(
                    f"migd is not available: {exc.message} (hint: {exc.hint})"
                ) from exc
            except MigdError as exc:
                raise WrapperFailure(f"migd refused the job: {exc.message}") from exc
        if notice.fired:
            waited = round(notice.waited_s())
            self.say(f"waited {waited} s for the partition")
            self.chirp({"MigdWaitReason": "", "MigdWaitedSeconds": waited})
        decision = lease.get("decision") or {}
        self.say(
            f"lease {lease['lease_id']}: {self.where(lease)}"
            + (f"; {decision['reason']}" if decision.get("reason") else "")
        )
        return lease

    def _announce_wait(self, since: float, memory: int) -> None:
        """Still waiting for the partition: say so (stderr, job ad); from the notice's
        thread while the lease call blocks, so it never raises."""
        try:
            reason = wait_reason(self.client.status(), self.spec.job_id, memory, self.spec.gpus)
        except MigdError as exc:
            reason = f"no free partition of {memory} MiB yet (migd status: {exc.message})"
        stamp = time.strftime("%H:%M:%S UTC", time.gmtime(since))
        self.say(f"waiting inside migd since {stamp}: {reason}")
        self.chirp({"MigdWaitingSince": int(since), "MigdWaitReason": reason[:500]})

    def release(self, lease: dict[str, Any], reason: str) -> dict[str, Any]:
        """Release the lease (every lease of a multi-GPU job's group); the reply of the
        first, with the highest peak of any."""
        results = [self._release_one(member, reason) for member in members(lease)]
        peaks = [r["peak_used_mib"] for r in results if isinstance(r.get("peak_used_mib"), int)]
        result = dict(results[0])
        if peaks:
            result["peak_used_mib"] = max(peaks)
        return result

    def _release_one(self, lease: Mapping[str, Any], reason: str) -> dict[str, Any]:
        try:
            result: dict[str, Any] = self.client.release(lease["lease_id"], reason=reason)
            return result
        except MigdError as exc:
            # The JOB_EXIT hook and migd's reaper release it if we cannot.
            self.say(f"could not release lease {lease['lease_id']}: {exc.message}")
            return {}

    def view(self, lease: dict[str, Any]) -> dict[str, Any] | None:
        """The lease as migd sees it now, or ``None`` when migd cannot be asked. Of a
        multi-GPU job's group: the first member migd no longer holds active, else the
        first member (one taken back stops the whole job)."""
        views = [self._member_view(member) for member in members(lease)]
        for view in views:
            if view is not None and view.get("state") != "active":
                return view
        return views[0]

    def _member_view(self, lease: Mapping[str, Any]) -> dict[str, Any] | None:
        try:
            view: dict[str, Any] = self.client.call(
                "get_lease", lease_id=lease["lease_id"], timeout_s=10.0
            )
        except MigdError:
            return None  # a daemon restart does not end a lease; the next poll asks again
        return view

    def usage(self, lease: dict[str, Any], job_pgid: int) -> int | None:
        """The job's GPU memory now (MiB), or ``None`` when it cannot be told apart; of a
        multi-GPU job, the most on any one of its GPUs (limits are per GPU)."""
        used = [self._member_usage(member, job_pgid) for member in members(lease)]
        known = [u for u in used if u is not None]
        return max(known) if known else None

    def _member_usage(self, lease: Mapping[str, Any], job_pgid: int) -> int | None:
        try:
            usage = self.client.call("usage", lease_id=lease["lease_id"], timeout_s=10.0)
        except MigdError:
            return None
        peak = usage.get("peak_used_mib")  # migd's own samples of this lease
        procs = usage.get("processes") or []
        if lease.get("mode") == "mps":
            # migd lists every client of the GPU: count only this job's process group.
            # (PIDs migd sees from outside a PID namespace are not ours to look up.)
            known = []
            for proc in procs:
                with contextlib.suppress(OSError):
                    if proc.get("used_mib") is not None and os.getpgid(proc["pid"]) == job_pgid:
                        known.append(int(proc["used_mib"]))
            now = sum(known) if known else None
        else:  # a MIG instance or a whole GPU: all of it is the job's
            used = usage.get("device_used_mib")
            now = int(used) if used is not None else None
        values = [v for v in (now, peak) if isinstance(v, int)]
        return max(values) if values else None

    def largest_here(self) -> int | None:
        """The largest partition this node could give the job (``None``: unknown)."""
        try:
            status = self.client.status()
        except MigdError as exc:
            self.debug(f"no node status for restart sizing: {exc.message}")
            return None
        pinned = self.spec.gpus
        best: int | None = None
        for gpu in status.get("gpus", []):
            mode = gpu.get("mode")
            if self.spec.mode not in ("auto", mode):
                continue
            if gpu.get("healthy") is False:
                continue
            if pinned and not any(
                str(gpu.get("uuid", "")).startswith(p) or p == str(gpu.get("index")) for p in pinned
            ):
                continue
            if mode == "mig":
                size = gpu.get("full_profile_mib")
            elif mode == "mps":
                size = (gpu.get("mps") or {}).get("capacity_mib") or gpu.get("memory_total_mib")
            elif mode == "exclusive":
                size = gpu.get("memory_total_mib")
            else:
                continue
            if isinstance(size, int) and size > (best or 0):
                best = size
        return best

    def where(self, lease: Mapping[str, Any]) -> str:
        """Where the job runs, in words (every GPU of a multi-GPU job)."""
        held = members(lease)
        if len(held) > 1:
            return f"{len(held)} GPUs: " + "; ".join(self.where(m) for m in held)
        if lease.get("profile"):
            return (
                f"{lease['profile']} ({lease.get('memory_limit_mib')} MiB, GPU {lease.get('gpu')})"
            )
        return f"an MPS share of {lease.get('memory_limit_mib')} MiB on GPU {lease.get('gpu')}"


def members(lease: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The leases a grant holds: a multi-GPU job's group, in GPU order, else itself."""
    group = lease.get("group")
    return list(group) if isinstance(group, list) and group else [lease]


__all__ = ["JobLeases", "NoBigger", "WrapperFailure", "members"]
