"""How much GPU memory a job asks for when it restarts after an OOM or a forecast.

One rule, used by the job wrapper (:mod:`migd.wrapper.runner`) when it restarts a
job on its node, and by the policy simulator (:mod:`migd.policysim.engine`) so that the
simulated pool restarts jobs exactly as the real one does. Pure: the caller says
what the job had, what the evidence asks for and what the node can hold.

The rule (:func:`restart_size`):

1. **Strictly bigger.** At least ``limit + 1`` MiB: migd right-sizes that to the
   next MIG profile up ([MIG-HT]: "the slice that meets the memory requirement").
2. **Growth.** Where there is no profile ladder (an MPS share or a whole GPU), the
   next size is ``growth × limit`` (2 by default); a job may ask for a growth
   factor on MIG too (``+MigdGrowthFactor``).
3. **Evidence.** At least what the evidence says the job needs: the forecast's
   need (point forecast plus safety margin), or the peak plus the allocation that
   failed when the OOM message states it.
4. **Rounded up to the node's ladder** when the caller knows it (the simulator
   passes the model's profile sizes; the wrapper leaves it to migd).
5. **What fits here.** If that is more than the largest partition the node offers
   but the largest is still bigger than what the job had, ask for the largest: a
   best try on this node (``capped``). Only when nothing bigger exists at all is
   there nothing to ask for here (``request_mib is None``), and the job must be
   re-matched elsewhere with ``wanted_mib``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from migd.errors import InvalidRequest

DEFAULT_GROWTH_WITHOUT_LADDER = 2.0


@dataclass(frozen=True, slots=True)
class RestartSize:
    """The size to restart a job with.

    Attributes:
        request_mib: what to ask this node for; ``None`` when the node has nothing
            bigger than what the job had.
        wanted_mib: what the evidence asks for, uncapped: the request for a node
            elsewhere (``RequestVRAM``) when this one cannot hold it.
        capped: ``request_mib`` is this node's largest partition, smaller than
            ``wanted_mib``: a best try, not a guarantee.
        largest_mib: the node's largest partition as the caller gave it.
        reason: one line for the job's stderr and the history.
    """

    request_mib: int | None
    wanted_mib: int
    capped: bool
    largest_mib: int | None
    reason: str


def restart_size(
    limit_mib: int,
    *,
    ladder: bool,
    largest_mib: int | None,
    needed_mib: float | None = None,
    growth_factor: float = 0.0,
    sizes: Sequence[int] = (),
) -> RestartSize:
    """The memory to ask for when a job that had ``limit_mib`` restarts.

    Args:
        limit_mib: the partition the job ran out of (MIG instance memory, MPS limit).
        ladder: the job ran on a MIG instance, whose next size up is the next
            profile; ``False`` for an MPS share or a whole GPU (growth applies).
        largest_mib: the largest partition this node could give the job, ``None``
            when unknown (then the request is not capped; migd refuses what it
            cannot hold).
        needed_mib: what the evidence says the job needs (forecast, or peak plus
            the failed allocation); ``None`` or 0 when there is none.
        growth_factor: ask for at least ``growth_factor × limit_mib``; 0 means the
            default: the next profile on a ladder, ``2 ×`` without one.
        sizes: the node's partition sizes, to round the request up to (optional).

    Raises:
        InvalidRequest: a limit that is not positive or a negative growth factor.
    """
    if limit_mib <= 0:
        raise InvalidRequest(f"restart sizing needs the partition's memory, got {limit_mib} MiB")
    if not (math.isfinite(growth_factor) and growth_factor >= 0):
        raise InvalidRequest(f"growth factor must be a non-negative number, got {growth_factor}")
    growth = growth_factor
    if growth <= 0 and not ladder:
        growth = DEFAULT_GROWTH_WITHOUT_LADDER
    wanted = limit_mib + 1
    why = "the next size up"
    if growth > 0 and math.ceil(limit_mib * growth) > wanted:
        wanted, why = math.ceil(limit_mib * growth), f"{growth:g} x {limit_mib} MiB"
    if needed_mib is not None and math.isfinite(needed_mib) and math.ceil(needed_mib) > wanted:
        wanted, why = math.ceil(needed_mib), "what the evidence says the job needs"
    bigger = sorted(s for s in sizes if s >= wanted)
    if bigger:
        wanted = bigger[0]
    if largest_mib is None or wanted <= largest_mib:
        return RestartSize(wanted, wanted, False, largest_mib, f">= {wanted} MiB ({why})")
    if largest_mib > limit_mib:
        return RestartSize(
            largest_mib,
            wanted,
            True,
            largest_mib,
            f"{largest_mib} MiB, the largest partition here (it wants {wanted} MiB: {why})",
        )
    return RestartSize(
        None,
        wanted,
        False,
        largest_mib,
        f"nothing bigger than {limit_mib} MiB on this node (largest {largest_mib} MiB); "
        f"it wants {wanted} MiB ({why})",
    )


__all__ = ["DEFAULT_GROWTH_WITHOUT_LADDER", "RestartSize", "restart_size"]
