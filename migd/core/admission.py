"""Admission: which GPUs of a node can ever serve a request, and why not (pure).

What :meth:`migd.core.scheduler.NodeScheduler.submit` checks before it keeps a lease,
and what it says when it refuses one: the candidate GPUs (those a request names, in a
mode that serves it), whether any of them could ever hold it (not just now), and each
candidate's reason for not holding it now. Nothing here changes the books; what
differs per GPU mode is asked of that mode's driver (``mode_ops``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from migd.core.geometry import Profile
from migd.core.gpu_modes import GpuModeOps, partition_request
from migd.core.gpus import GpuMode, ManagedGpu
from migd.core.groups import pinned
from migd.core.leases import Lease, LeaseRequest
from migd.core.planner import Sizing, never_fits_error
from migd.core.states import StateSpace
from migd.errors import InvalidRequest, RequestTooLarge

#: The driver of a GPU's mode (``NodeScheduler.mode_ops``).
ModeOf = Callable[[ManagedGpu], GpuModeOps]


def candidate_gpus(
    gpus: Iterable[ManagedGpu], request: LeaseRequest, mode_ops: ModeOf
) -> list[ManagedGpu]:
    """The GPUs that may serve ``request``: those it names (all when it names none),
    not off, in a mode that serves its mode.

    Raises:
        InvalidRequest: it names GPUs this node does not have, or no GPU serves its mode.
    """
    gpus = list(gpus)
    found = [g for g in gpus if g.mode is not GpuMode.OFF]
    if request.gpu_uuids:
        wanted = [u.strip() for u in request.gpu_uuids if u.strip()]
        chosen = [
            g for g in found if any(g.uuid.startswith(w) or str(g.index) == w for w in wanted)
        ]
        if not chosen:
            raise InvalidRequest(
                f"no managed GPU matches {', '.join(wanted)}",
                hint="use GPU UUIDs (or short UUIDs) as AssignedGPUs shows, or indices",
            )
        found = chosen
    serving = [g for g in found if mode_ops(g).serves(g, request.mode)]
    if serving:
        return serving
    elsewhere = [
        g
        for g in gpus
        if g.mode is not GpuMode.OFF and g not in found and mode_ops(g).serves(g, request.mode)
    ]
    if elsewhere:
        # The request was pinned (HTCondor's AssignedGPUs) to a GPU of the wrong mode:
        # say which GPU would have served it, not that none does.
        asked = ", ".join(f"GPU {g.index} ({g.mode})" for g in found)
        others = ", ".join(f"GPU {g.index} ({g.mode})" for g in elsewhere)
        raise InvalidRequest(
            f"the GPU this job was given, {asked}, does not serve mode={request.mode}; "
            f"on this node {others} does",
            hint="the access point's MIGDMODE transform (20-migd-access-point.config) makes "
            "HTCondor assign a GPU that serves the job's MigdMode; install it, or add "
            'require_gpus = stringListIMember("<mode>", MigdServes) to the job',
        )
    raise InvalidRequest(
        f"no GPU on this node serves mode={request.mode}",
        hint="use mode=auto, or configure a GPU for that mode in migd.toml",
    )


def ever_fits(lease: Lease, gpus: Sequence[ManagedGpu], mode_ops: ModeOf) -> dict[str, Profile]:
    """The profile the request right-sizes to on each MIG model among ``gpus``.

    Raises:
        RequestTooLarge: nothing here could ever hold it; the message says why for
            each model (too much memory, more compute slices than any profile, a
            named profile too small).
        UnknownProfile: it names a profile no GPU here has.
    """
    sizes: dict[str, Profile] = {}
    sizings: list[tuple[StateSpace, Sizing]] = []
    others: list[str] = []
    largest = 0
    fits = False
    for g in gpus:
        fit = mode_ops(g).ever_fits(g, lease.request)
        fits = fits or fit.fits
        largest = max(largest, fit.largest_mib)
        if fit.demand is not None:
            sizes.setdefault(*fit.demand)
        if fit.sizing is not None:
            sizings.append(fit.sizing)
        if fit.why:
            others.append(fit.why)
    if not fits:
        raise never_fits_error(partition_request(lease.request), sizings, others, largest)
    return sizes


def group_ever_fits(
    leases: Sequence[Lease], gpus: Iterable[ManagedGpu], mode_ops: ModeOf
) -> dict[str, Profile]:
    """:func:`ever_fits` for a lease group (one job on several GPUs): every member must
    fit, and unless all are pinned to a GPU each, the node needs a GPU per member.

    Raises:
        RequestTooLarge: a member can never fit here, or fewer GPUs here serve the
            request than it has members.
        InvalidRequest: a member names GPUs this node does not have.
    """
    gpus = list(gpus)
    usable: set[int] = set()
    free = 0  # members not pinned to one GPU: each needs a GPU of its own
    sizes: dict[str, Profile] = {}
    for lease in leases:
        candidates = candidate_gpus(gpus, lease.request, mode_ops)
        sizes.update(ever_fits(lease, candidates, mode_ops))
        usable.update(g.index for g in candidates)
        free += not pinned(lease)
    if free and len(usable) < len(leases):
        raise RequestTooLarge(
            f"the job asks for {len(leases)} GPUs; {len(usable)} GPU(s) on this node "
            "serve its request",
            hint="ask for fewer GPUs, or match a node with as many",
        )
    return sizes


def why_not(
    lease: Lease, gpus: Iterable[ManagedGpu], mode_ops: ModeOf, queued: int
) -> list[dict[str, Any]]:
    """Why ``lease`` cannot be placed now, per candidate GPU (a refusal's
    ``considered``); ``queued``: the requests in the queue, itself included."""
    try:
        candidates = candidate_gpus(gpus, lease.request, mode_ops)
    except InvalidRequest as exc:
        return [{"why": exc.message}]
    out = [mode_ops(g).why_not(g) for g in candidates]
    if queued > 1:
        out.append({"why": f"{queued - 1} queued request(s) go first"})
    return out


__all__ = ["ModeOf", "candidate_gpus", "ever_fits", "group_ever_fits", "why_not"]
