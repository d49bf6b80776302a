"""The hybrid policy: per request, a MIG instance of its own or a share of an MPS server
inside a MIG instance, and how large those MPS host instances are (pure).

Why: inside MIG, placement has almost no headroom left (migd is within a few points of
the slice-area bound); what a GPU still loses is *slots*. A job far smaller than the
smallest instance wastes most of it, and [Voigtlaender] Table 2 traces MPS's lead over
MIG (9.36x against 7.29x of exclusive) to "the number of available job slots". MPS
alone gives up memory and fault isolation between users, though. The hybrid packs
small jobs like MPS and keeps users apart by MIG: an MPS server runs inside a MIG
instance (a *host*), serves one user (MPS's own rule, unless ``multi_user``), and pins
every client's memory (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``).

**Which jobs share** (:meth:`HybridPolicy.route`), with rule ``either`` (the default):

* a job that opts in (``MigdMode = "mps"`` in its submit file, request mode ``mps``)
  always shares; one that asks for ``mig`` or names a profile never does;
* any other job shares when sharing *packs it better*: some host profile holds more of
  it per memory slice (``floor(capacity / request) / memory slices``) than its own
  smallest instance holds (one per that profile's memory slices). So a 3 GB job on an
  A100-40GB shares (13 in a ``7g.40gb`` host: 1.6 per slice, against 1 in a
  ``1g.5gb``), a 4.8 GB job does not (8 per 8 slices: no gain, and MIG isolates). An
  admin may cap this with ``share_max_mib``.

``size`` uses only the second rule (opt-ins too must pack better), ``opt-in`` only the
first.

**Host size** (:meth:`HybridPolicy.host_profiles`): from observed demand, the MiB that
this user's share-bound requests pin on the node now (this request, those queued
behind it, and those running in hosts), the smallest profile whose MPS capacity holds
it, else the largest; then the other profiles that still hold this request, larger
before smaller. Profiles that hold no more of the job per memory slice than its own
instance are left out (a ``2g.10gb`` host holds two 3 GB jobs, as two ``1g.5gb`` do).
The scheduler takes the first one its planner can place: creating an
instance, reusing an idle one or fusing idle ones into it (fission/fusion). Hosts
shrink when idle: a host whose last client leaves is destroyed at once (the daemon stops
its MPS server first; a live server must never be handed to a MIG lease), and the next
one is sized to the demand then.

Every decision carries a one-line reason the scheduler appends to the lease's
decision (``migctl explain``, status).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from migd.core.geometry import Profile
from migd.core.gpus import RequestMode
from migd.errors import InvalidRequest


class ShareRule(StrEnum):
    """Which jobs may share an MPS host (module docstring)."""

    SIZE = "size"  # only jobs that pack better shared
    OPT_IN = "opt-in"  # only jobs that ask for mode=mps
    EITHER = "either"  # an opt-in, or a job that packs better shared


@dataclass(frozen=True)
class Route:
    """The hybrid's answer for one request.

    Attributes:
        share: the request goes to an MPS share inside a MIG instance.
        reason: why, for ``migctl explain``.
    """

    share: bool
    reason: str


@dataclass(frozen=True)
class HybridPolicy:
    """Configuration of the hybrid policy (``mode = "hybrid"`` on a GPU).

    Attributes:
        rule: which jobs share.
        share_max_mib: requests above this never share by size (None: no cap).
        reserve_mib: MiB an MPS server keeps of its instance (the scheduler's
            ``mps_reserve_mib``).
    """

    rule: ShareRule = ShareRule.EITHER
    share_max_mib: int | None = None
    reserve_mib: int = 1024

    def __post_init__(self) -> None:
        if self.share_max_mib is not None and self.share_max_mib <= 0:
            raise InvalidRequest("hybrid share_max_mib must be positive")

    def capacity(self, profile: Profile) -> int:
        """MiB an MPS server inside ``profile`` can pin for clients."""
        return max(0, profile.memory_mib - self.reserve_mib)

    def route(
        self,
        profiles: Sequence[Profile],
        memory_mib: int,
        min_compute: int = 0,
        mode: RequestMode = "auto",
        named_profile: bool = False,
    ) -> Route:
        """Share or own instance, for a request of ``memory_mib`` x one client that asks
        for ``mode`` (what the job wants, not what the GPU runs).

        ``profiles`` are the GPU's profiles (its profile set).
        """
        if mode == "mig" or named_profile:
            return Route(False, "asks for a MIG instance of its own")
        opted = mode == "mps"
        if opted and self.rule is not ShareRule.SIZE:
            return Route(True, "opted in to sharing (mode=mps)")
        if self.rule is ShareRule.OPT_IN:
            return Route(False, "did not opt in to sharing (rule opt-in)")
        if self.share_max_mib is not None and memory_mib > self.share_max_mib:
            return Route(False, f"{memory_mib} MiB is above share_max_mib {self.share_max_mib}")
        own = self._own(profiles, memory_mib, min_compute)
        if own is None:
            return Route(False, "no profile holds it")
        own_density = 1.0 / own.memory_slices
        best: tuple[float, Profile] | None = None
        for p in profiles:
            if p.compute_slices < min_compute:
                continue
            k = self.capacity(p) // memory_mib
            if k < 1:
                continue
            density = k / p.memory_slices
            if best is None or density > best[0]:
                best = (density, p)
        if best is None or best[0] <= own_density + 1e-9:
            return Route(
                False,
                f"{memory_mib} MiB packs no better shared: own {own.name} holds "
                f"{own_density:.2f} per memory slice"
                + (f", the best host {best[1].name} {best[0]:.2f}" if best else ""),
            )
        return Route(
            True,
            f"{memory_mib} MiB packs {best[0]:.2f} per memory slice shared in "
            f"{best[1].name}, {own_density:.2f} in its own {own.name}",
        )

    @staticmethod
    def _own(profiles: Sequence[Profile], memory_mib: int, min_compute: int) -> Profile | None:
        """The instance the request would get on its own (fewest memory slices)."""
        fits = [
            p for p in profiles if p.memory_mib >= memory_mib and p.compute_slices >= min_compute
        ]
        if not fits:
            return None
        return min(fits, key=lambda p: (p.memory_slices, p.compute_slices, p.memory_mib))

    def host_profiles(
        self, profiles: Sequence[Profile], memory_mib: int, demand_mib: int, min_compute: int = 0
    ) -> tuple[tuple[Profile, ...], str]:
        """Host profiles to try for a new host, best first, and why.

        ``demand_mib``: MiB the user's share-bound requests pin on the node now,
        this one included.
        """
        holding = [
            p
            for p in profiles
            if self.capacity(p) >= memory_mib and p.compute_slices >= min_compute
        ]
        if not holding:
            return (), f"no profile's MPS capacity holds {memory_mib} MiB"
        own = self._own(profiles, memory_mib, min_compute)
        if own is not None:
            # a host that holds no more of these jobs per memory slice than their own
            # instances do only adds a server: left out (kept for opt-ins if nothing packs)
            dense = [
                p
                for p in holding
                if (self.capacity(p) // memory_mib) / p.memory_slices > 1 / own.memory_slices
            ]
            holding = dense or holding
        holding.sort(key=lambda p: (self.capacity(p), p.compute_slices))
        want = next((p for p in holding if self.capacity(p) >= demand_mib), holding[-1])
        i = holding.index(want)
        order = (want, *holding[i + 1 :], *reversed(holding[:i]))
        why = (
            f"host {want.name} for {demand_mib} MiB of sharing demand "
            f"({self.capacity(want)} MiB capacity)"
        )
        return order, why


__all__ = ["HybridPolicy", "Route", "ShareRule"]
