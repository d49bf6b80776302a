"""The partition state machine of one GPU model, with precomputed reachability.

A *state* is the set of placed GPU instances ``(profile, start)`` on one GPU.
Transitions are *allocate* (add an instance at a legal start) and *release*
(remove one). [MIG-HT] (MIGM, §4.2) defines the **future configuration
reachability** of a state as the number of full ("fully configured") states
reachable from it by legal allocations; a full state is one to which no
profile of the set can be added. Because every constraint (overlap, per-profile
instance limits, shared caps such as the single OFA) is hereditary, every
subset of a valid state is valid, and the full states reachable from ``s`` are
exactly the full states that contain ``s``. That gives a cheap and obviously
correct precomputation:

1. enumerate every valid state once (a set of placements built in atom order),
2. mark the full ones,
3. for each full state ``M`` walk its ``2^|M|`` subsets and add ``M``'s
   contribution to each: reachability ``+1``, per-profile instance counts of
   ``M`` (for the demand-weighted variant), best compute/unit use of ``M``
   (for wasted-slice accounting).

States are keyed by an ``int`` bit mask over the model's *atoms* (every legal
``(profile, start)`` pair of the chosen profile set), so a lookup is one dict
access. :func:`state_space` memoizes one :class:`StateSpace` per model and
profile set; building the largest built-in table takes milliseconds
(``bench/bench_core.py``), so nothing is cached on disk.

The demand-weighted reachability ([Siavashi]'s expected configuration capability,
generalised from "placements now" to "reachable full layouts") of state ``s``
under a profile-demand mix ``d`` is::

    W_d(s) = sum over full M ⊇ s of  sum_p d_p * n_p(M \\ s)

i.e. every reachable full layout counts with the number of further instances of
each profile it can still host, weighted by how often that profile is asked
for. It is a dot product of ``d`` with the precomputed vector
``hostable(s)[p] = sum_{M ⊇ s} n_p(M) - R(s) * n_p(s)``, so a new demand mix
needs no recomputation.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache

from migd.core.geometry import Geometry, Profile, Variant
from migd.errors import (
    ExclusiveConflict,
    InstanceLimitReached,
    InstanceNotFound,
    InvalidStart,
    PlacementOverlap,
    UnknownProfile,
)

StateKey = int
"""Canonical key of a state: bit ``i`` set when atom ``i`` is placed."""

EMPTY: StateKey = 0


@dataclass(frozen=True, slots=True)
class Atom:
    """One legal placement of one profile: the unit of a state."""

    index: int
    profile: Profile
    start: int
    units: int  # bit mask of occupied placement units

    @property
    def end(self) -> int:
        return self.start + self.profile.memory_slices

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


@dataclass(frozen=True, slots=True)
class StateInfo:
    """Precomputed facts about one valid state."""

    key: StateKey
    full: bool
    reachability: int  # number of full states that contain this one
    hostable: tuple[int, ...]  # per profile (space.profiles order): instances still hostable
    best_compute: int  # most compute slices any reachable full state uses
    best_units: int  # most placement units any reachable full state covers
    used_slices: int  # memory slices + compute slices of its instances ([Turkkan])


class StateSpace:
    """Every valid partition state of one model over one profile set, precomputed.

    Args:
        geometry: the model's geometry.
        profiles: the profile set (see :meth:`Geometry.profile_set`); defaults to
            ``standard``.
    """

    def __init__(self, geometry: Geometry, profiles: Sequence[Profile] | None = None) -> None:
        self.geometry = geometry
        self.profiles: tuple[Profile, ...] = tuple(
            profiles if profiles is not None else geometry.profile_set("standard")
        )
        self._profile_pos = {p.profile_id: i for i, p in enumerate(self.profiles)}
        # describe()'s text per state: every grant records its state before and after
        self._described: dict[StateKey, str] = {}
        atoms: list[Atom] = []
        for p in self.profiles:
            for start in sorted(p.starts):
                atoms.append(Atom(len(atoms), p, start, p.units_mask(start)))
        self.atoms: tuple[Atom, ...] = tuple(atoms)
        self._atom_by_place = {(a.profile.profile_id, a.start): a for a in atoms}
        self._atoms_of: dict[int, tuple[Atom, ...]] = {
            p.profile_id: tuple(a for a in atoms if a.profile is p) for p in self.profiles
        }
        self._atom_profile_pos = [self._profile_pos[a.profile.profile_id] for a in atoms]
        # Shared caps restricted to this set: (profile positions, max, reason). The
        # enumeration checks only those the instance limits do not imply already; error
        # messages name every cap a transition breaks (a second +me on an A100 breaks
        # both its own limit of one and the single OFA, and the OFA is the reason).
        self._all_groups: list[tuple[frozenset[int], int, str]] = []
        for group in geometry.exclusive_groups:
            members = frozenset(
                self._profile_pos[pid] for pid in group.profile_ids if pid in self._profile_pos
            )
            if members:
                self._all_groups.append((members, group.max_instances, group.reason))
        self._groups = [
            g for g in self._all_groups if g[1] < sum(self.profiles[m].max_instances for m in g[0])
        ]
        self._all_engines: list[tuple[str, int, tuple[int, ...]]] = []
        budget = geometry.engine_budget or {}
        if budget and all(p.engines is not None for p in self.profiles):
            for engine, cap in budget.items():
                need = tuple((p.engines or {}).get(engine, 0) for p in self.profiles)
                self._all_engines.append((engine, cap, need))
        self._engines = [
            (engine, cap, need)
            for engine, cap, need in self._all_engines
            if sum(n * p.max_instances for n, p in zip(need, self.profiles, strict=True)) > cap
        ]
        self._info: dict[StateKey, StateInfo] = {}
        self._build()

    # -- precomputation ---------------------------------------------------------------------

    def _build(self) -> None:
        atoms = self.atoms
        n_profiles = len(self.profiles)
        max_inst = [p.max_instances for p in self.profiles]
        states: list[tuple[StateKey, int, tuple[int, ...]]] = []  # key, units, counts

        def extend(key: StateKey, units: int, counts: list[int], first: int) -> None:
            states.append((key, units, tuple(counts)))
            for a in atoms[first:]:
                pos = self._atom_profile_pos[a.index]
                if units & a.units or counts[pos] >= max_inst[pos]:
                    continue
                counts[pos] += 1
                if self._caps_ok(counts):
                    extend(key | (1 << a.index), units | a.units, counts, a.index + 1)
                counts[pos] -= 1

        extend(EMPTY, 0, [0] * n_profiles, 0)

        full: list[tuple[StateKey, tuple[int, ...], int, int]] = []
        for key, units, counts in states:
            if not any(self._fits(units, counts, a) for a in atoms):
                compute = sum(
                    c * p.compute_slices for c, p in zip(counts, self.profiles, strict=True)
                )
                full.append((key, counts, compute, units.bit_count()))

        reach: dict[StateKey, int] = {}
        totals: dict[StateKey, list[int]] = {}
        best_c: dict[StateKey, int] = {}
        best_u: dict[StateKey, int] = {}
        for fkey, fcounts, fcompute, funits in full:
            sub = fkey
            while True:
                reach[sub] = reach.get(sub, 0) + 1
                acc = totals.get(sub)
                if acc is None:
                    totals[sub] = list(fcounts)
                else:
                    for i, c in enumerate(fcounts):
                        acc[i] += c
                if best_c.get(sub, -1) < fcompute:
                    best_c[sub] = fcompute
                if best_u.get(sub, -1) < funits:
                    best_u[sub] = funits
                if sub == 0:
                    break
                sub = (sub - 1) & fkey

        full_keys = {f[0] for f in full}
        weight = [p.memory_slices + p.compute_slices for p in self.profiles]
        for key, _units, counts in states:
            r = reach[key]
            hostable = tuple(t - r * c for t, c in zip(totals[key], counts, strict=True))
            self._info[key] = StateInfo(
                key=key,
                full=key in full_keys,
                reachability=r,
                hostable=hostable,
                best_compute=best_c[key],
                best_units=best_u[key],
                used_slices=sum(c * w for c, w in zip(counts, weight, strict=True)),
            )

    def _caps_ok(self, counts: Sequence[int]) -> bool:
        for members, cap, _ in self._groups:
            if sum(counts[m] for m in members) > cap:
                return False
        for _engine, cap, need in self._engines:
            if sum(c * n for c, n in zip(counts, need, strict=True)) > cap:
                return False
        return True

    def _fits(self, units: int, counts: tuple[int, ...] | list[int], atom: Atom) -> bool:
        pos = self._atom_profile_pos[atom.index]
        if units & atom.units or counts[pos] >= self.profiles[pos].max_instances:
            return False
        trial = list(counts)
        trial[pos] += 1
        return self._caps_ok(trial)

    # -- lookups ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: object) -> bool:
        return key in self._info

    def keys(self) -> Iterator[StateKey]:
        return iter(self._info)

    def __iter__(self) -> Iterator[StateKey]:
        return iter(self._info)

    def info(self, key: StateKey) -> StateInfo:
        return self._info[key]

    def reachability(self, key: StateKey) -> int:
        """[MIG-HT]'s future configuration reachability of ``key`` (O(1))."""
        return self._info[key].reachability

    def weighted_reachability(self, key: StateKey, demand: Mapping[int, float]) -> float:
        """Demand-weighted reachability; ``demand`` maps profile ID to weight."""
        hostable = self._info[key].hostable
        return sum(
            demand.get(p.profile_id, 0.0) * h for p, h in zip(self.profiles, hostable, strict=True)
        )

    @property
    def full_states(self) -> list[StateKey]:
        return [k for k, i in self._info.items() if i.full]

    def atom(self, profile: Profile | int | str, start: int) -> Atom:
        """The atom for ``profile`` at ``start``.

        Raises:
            UnknownProfile: the profile is not in this space's profile set.
            InvalidStart: ``start`` is not a legal placement of the profile.
        """
        prof = self.member(profile)
        found = self._atom_by_place.get((prof.profile_id, start))
        if found is None:
            raise InvalidStart(
                f"{prof.name} cannot start at unit {start} on {self.geometry.model}",
                hint=f"legal starts: {', '.join(map(str, sorted(prof.starts)))}",
                profile=prof.name,
                start=start,
            )
        return found

    def member(self, profile: Profile | int | str) -> Profile:
        """Resolve ``profile`` to a profile of this set.

        An instance of a profile outside the set (say a ``+me`` instance an admin made
        while the set is ``standard``) maps to the set's profile with the same compute
        slices, memory slices and starts: for placement purposes the two are the same.
        """
        if isinstance(profile, Profile):
            pos = self._profile_pos.get(profile.profile_id)
            if pos is not None and self.profiles[pos] is profile:
                return profile  # the common case, on every planning hot path
        prof = self.geometry.profile(profile)
        if prof.profile_id in self._profile_pos:
            return self.profiles[self._profile_pos[prof.profile_id]]
        for candidate in self.profiles:
            if (
                candidate.variant is Variant.BASE
                and candidate.compute_slices == prof.compute_slices
                and candidate.memory_slices == prof.memory_slices
                and candidate.starts == prof.starts
            ):
                return candidate
        raise UnknownProfile(
            f"profile {prof.name} is not in this state machine's profile set",
            hint="profiles: " + ", ".join(p.name for p in self.profiles),
            profile=prof.name,
        )

    def placements(self, key: StateKey) -> tuple[Atom, ...]:
        """The placed instances of a state, in atom order."""
        atoms = self.atoms
        out = []
        while key:
            low = key & -key
            out.append(atoms[low.bit_length() - 1])
            key ^= low
        return tuple(out)

    def atoms_of(self, profile: Profile) -> tuple[Atom, ...]:
        """Every legal placement of ``profile`` (a member of this set), ascending start."""
        return self._atoms_of[self.member(profile).profile_id]

    def key_of(self, placements: Iterable[tuple[Profile | int | str, int]]) -> StateKey:
        """Canonical key of a set of ``(profile, start)`` placements, validating it.

        Raises:
            IllegalTransition: the placements overlap or break a limit (the subclass says which).
        """
        key = EMPTY
        for profile, start in placements:
            key = self.allocate(key, profile, start)
        return key

    # -- transitions ------------------------------------------------------------------------

    def allocate(self, key: StateKey, profile: Profile | int | str, start: int) -> StateKey:
        """The state after creating ``profile`` at ``start``.

        Raises:
            InvalidStart, PlacementOverlap, InstanceLimitReached, ExclusiveConflict:
                the transition is illegal; the message says why.
        """
        atom = self.atom(profile, start)
        new = key | (1 << atom.index)
        if new in self._info and new != key:
            return new
        self._explain_illegal(key, atom)
        raise AssertionError("unreachable: illegal transition not explained")  # pragma: no cover

    def release(self, key: StateKey, profile: Profile | int | str, start: int) -> StateKey:
        """The state after destroying the instance ``profile`` at ``start``.

        Raises:
            InstanceNotFound: no such instance in the state.
        """
        atom = self.atom(profile, start)
        if not key >> atom.index & 1:
            raise InstanceNotFound(
                f"no {atom} instance to release",
                hint="`migctl status` shows the instances",
                profile=atom.profile.name,
                start=start,
            )
        return key & ~(1 << atom.index)

    def can_allocate(self, key: StateKey, atom: Atom) -> bool:
        return not key >> atom.index & 1 and (key | (1 << atom.index)) in self._info

    def legal_starts(self, key: StateKey, profile: Profile | int | str) -> list[int]:
        """Starts at which ``profile`` can be created in state ``key`` now (ascending)."""
        prof = self.member(profile)
        return [a.start for a in self._atoms_of[prof.profile_id] if self.can_allocate(key, a)]

    def creatable(self, key: StateKey) -> dict[str, list[int]]:
        """Every profile of the set that can still be created, with its legal starts."""
        out: dict[str, list[int]] = {}
        for p in self.profiles:
            starts = self.legal_starts(key, p)
            if starts:
                out[p.name] = starts
        return out

    def configuration_capability(self, key: StateKey) -> int:
        """[Siavashi]'s CC: the number of (profile, start) placements possible right now."""
        return sum(1 for a in self.atoms if self.can_allocate(key, a))

    def wasted_slices(self, key: StateKey) -> tuple[int, int]:
        """(compute, memory) slices no completion of this state can ever use ([Turkkan])."""
        info = self._info[key]
        return (
            self.geometry.compute_slices - info.best_compute,
            self.geometry.units - info.best_units,
        )

    def _explain_illegal(self, key: StateKey, atom: Atom) -> None:
        if key >> atom.index & 1:
            raise PlacementOverlap(
                f"{atom} already exists", profile=atom.profile.name, start=atom.start
            )
        for other in self.placements(key):
            if other.units & atom.units:
                raise PlacementOverlap(
                    f"{atom} (units {atom.start}-{atom.end - 1}) overlaps {other} "
                    f"(units {other.start}-{other.end - 1})",
                    hint="choose another start or release the overlapping instance",
                    profile=atom.profile.name,
                    start=atom.start,
                    blocking=str(other),
                )
        counts = [0] * len(self.profiles)
        for other in self.placements(key):
            counts[self._atom_profile_pos[other.index]] += 1
        pos = self._atom_profile_pos[atom.index]
        counts[pos] += 1
        limit = atom.profile.max_instances
        own = f"; {atom.profile.name} itself allows at most {limit}" if counts[pos] > limit else ""
        for members, cap, reason in self._all_groups:
            if pos in members and sum(counts[m] for m in members) > cap:
                names = ", ".join(self.profiles[m].name for m in sorted(members))
                raise ExclusiveConflict(
                    f"only {cap} instance(s) of {names} can exist at once on "
                    f"{self.geometry.model} ({reason}){own}",
                    hint="release the existing one or ask for a profile without it",
                    profile=atom.profile.name,
                )
        for engine, cap, need in self._all_engines:
            if need[pos] and sum(c * n for c, n in zip(counts, need, strict=True)) > cap:
                raise ExclusiveConflict(
                    f"{atom.profile.name} would exceed the GPU's {cap} {engine.upper()} "
                    f"engine(s) on {self.geometry.model}{own}",
                    hint="release an instance that holds one, or ask for a profile without it",
                    profile=atom.profile.name,
                )
        if counts[pos] > limit:
            raise InstanceLimitReached(
                f"{atom.profile.name} allows at most {limit} instance(s) on {self.geometry.model}",
                profile=atom.profile.name,
            )
        raise PlacementOverlap(f"{atom} cannot be added to this state")  # pragma: no cover


@cache
def _space(geometry: Geometry, profile_ids: tuple[int, ...]) -> StateSpace:
    return StateSpace(geometry, tuple(geometry.by_id(pid) for pid in profile_ids))


def state_space(geometry: Geometry, profiles: str | Sequence[str] = "standard") -> StateSpace:
    """The (memoized) state space of ``geometry`` over a profile-set option."""
    chosen = geometry.profile_set(profiles)
    return _space(geometry, tuple(p.profile_id for p in chosen))


def describe(space: StateSpace, key: StateKey) -> str:
    """``"1g.5gb@6 3g.20gb@0"``: a state for logs and error messages."""
    text = space._described.get(key)
    if text is None:
        atoms = sorted(space.placements(key), key=lambda a: a.start)
        text = " ".join(str(a) for a in atoms) or "(empty)"
        if len(space._described) < 65536:  # the states of a space are finite; a bound anyway
            space._described[key] = text
    return text
