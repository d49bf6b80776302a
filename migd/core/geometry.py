"""MIG geometry of one GPU model: profiles, legal placements and shared caps.

Pure data, no I/O. A geometry comes either from the built-in catalog
(:mod:`migd.core.catalog`, derived from ``tests/data/mig-tables.json``)
or from what NVML reports on a live GPU (:meth:`Geometry.from_nvml`), so
unknown models work from NVML data alone.

Placements are in NVML placement units ("memory slices"): ``start`` is the
first unit, ``memory_slices`` the number of units, exactly as
``nvmlDeviceGetGpuInstancePossiblePlacements`` and ``nvidia-smi mig -lgipp``
report them. The grid size is per model (4 on A30, 8 on A100/H100/B200, 12 on
RTX PRO 6000); nothing here assumes 8.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from migd.errors import UnknownProfile


class Variant(StrEnum):
    """Media-engine variant of a profile (go-nvlib ``mig_profile.go`` naming)."""

    BASE = "base"
    ME = "me"  # +me: carries the GPU's single OFA/JPEG
    ME_ALL = "me_all"  # +me.all: all media engines
    NO_ME = "no_me"  # -me: no media engines
    GFX = "gfx"  # +gfx: graphics capable

    @property
    def suffix(self) -> str:
        return {"base": "", "me": "+me", "me_all": "+me.all", "no_me": "-me", "gfx": "+gfx"}[
            self.value
        ]


# NVML_GPU_INSTANCE_PROFILE_* index -> variant (nvml.h; go-nvlib mig_profile.go).
_VARIANT_BY_NVML_INDEX: dict[int, Variant] = {
    0x7: Variant.ME,
    0x8: Variant.ME,
    0xA: Variant.GFX,
    0xB: Variant.GFX,
    0xC: Variant.GFX,
    0x11: Variant.GFX,
    0xD: Variant.NO_ME,
    0xE: Variant.NO_ME,
    0xF: Variant.ME_ALL,
    0x10: Variant.ME_ALL,
}
NVML_PROFILE_1_SLICE_REV2 = 0x9  # the 1g profile with two memory slices (1g.10gb on A100-40GB)


def variant_for_nvml_index(nvml_index: int) -> Variant:
    return _VARIANT_BY_NVML_INDEX.get(nvml_index, Variant.BASE)


@dataclass(frozen=True, slots=True)
class Profile:
    """A GPU instance profile of one model.

    Attributes:
        profile_id: the ID ``nvidia-smi mig -lgip`` shows (``nvmlGpuInstanceProfileInfo_t.id``),
            passed to every create/placement call.
        name: canonical name, e.g. ``"3g.40gb"``.
        nvml_index: the ``NVML_GPU_INSTANCE_PROFILE_*`` index given to
            ``nvmlDeviceGetGpuInstanceProfileInfo``.
        compute_slices: GPU (compute) slices, the ``Ng`` in the name.
        memory_slices: placement size in units (== NVML ``placement.size``).
        memory_mib: usable memory of an instance.
        max_instances: ``Instances Total`` of ``-lgip``.
        starts: legal placement starts, ascending.
        default_order: the driver's own preference when no placement is given.
    """

    profile_id: int
    name: str
    nvml_index: int
    compute_slices: int
    memory_slices: int
    memory_mib: int
    max_instances: int
    starts: tuple[int, ...]
    default_order: tuple[int, ...]
    variant: Variant = Variant.BASE
    aliases: tuple[str, ...] = ()
    memory_inferred: bool = False
    sm_count: int | None = None
    engines: Mapping[str, int] | None = field(default=None, hash=False)

    def units_mask(self, start: int) -> int:
        """Bit mask of the placement units an instance at ``start`` occupies."""
        return ((1 << self.memory_slices) - 1) << start

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, slots=True)
class ExclusiveGroup:
    """Profiles that share a capped resource, e.g. the single OFA of all ``+me`` profiles."""

    profile_ids: frozenset[int]
    max_instances: int
    reason: str


@dataclass(frozen=True, slots=True)
class NvmlProfileInfo:
    """What NVML says about one profile (a copy of ``nvmlGpuInstanceProfileInfo_v2``)."""

    nvml_index: int
    profile_id: int
    compute_slices: int
    max_instances: int
    memory_mib: int
    name: str = ""
    multiprocessor_count: int | None = None


_NAME_RE = re.compile(r"^(\d+)g\.(\d+)gb(\+me\.all|\+me|-me|\+gfx)?$")


def normalize_profile_name(text: str) -> str:
    """``"MIG 3g.40gb"`` -> ``"3g.40gb"``; lower case, no blanks."""
    name = text.strip().lower()
    if name.startswith("mig "):
        name = name[4:]
    return name.replace(" ", "")


@dataclass(frozen=True)
class Geometry:
    """Everything the state machine needs to know about one GPU model."""

    model: str
    display_name: str
    units: int
    compute_slices: int
    memory_mib: int
    profiles: tuple[Profile, ...]
    exclusive_groups: tuple[ExclusiveGroup, ...] = ()
    engine_budget: Mapping[str, int] | None = field(default=None, hash=False)
    pci_device_ids: tuple[int, ...] = ()
    source: str = "builtin"
    placement_status: str = ""
    # Lookup tables built from ``profiles`` (so ``dataclasses.replace`` rebuilds them).
    _by_id: dict[int, Profile] = field(init=False, default_factory=dict, compare=False, repr=False)
    _by_name: dict[str, Profile] = field(
        init=False, default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        for p in self.profiles:
            self._by_id[p.profile_id] = p
            self._by_name[p.name] = p
            for alias in p.aliases:
                self._by_name.setdefault(normalize_profile_name(alias), p)
            last = max(s + p.memory_slices for s in p.starts)
            if last > self.units:
                raise ValueError(f"{self.model}: {p.name} placement ends past unit {self.units}")

    # -- lookups ---------------------------------------------------------------------------

    def by_id(self, profile_id: int) -> Profile:
        try:
            return self._by_id[profile_id]
        except KeyError:
            raise self._unknown(str(profile_id)) from None

    def profile(self, ref: str | int | Profile) -> Profile:
        """Find a profile by canonical name, driver variant, ``MIG`` prefix or numeric ID.

        Driver versions name the same profile differently (``3g.39gb`` vs ``3g.40gb``,
        ``1g.24gb`` vs ``1g.23gb`` on GB200): a name with the right compute slices and
        variant whose memory is within 5 % of a profile's size matches it. The margin is
        relative, so another model's small profile does not match (``1g.5gb`` is not
        A30's ``1g.6gb``). ``+me`` and the other variants are names of their own
        (``1g.5gb+me``), never confused with the base profile.

        Raises:
            UnknownProfile: nothing matches; the message lists the valid names.
        """
        if isinstance(ref, Profile):
            return self.by_id(ref.profile_id)
        if isinstance(ref, int):
            return self.by_id(ref)
        name = normalize_profile_name(ref)
        if name.isdigit():
            return self.by_id(int(name))
        if name.startswith("id:") and name[3:].isdigit():
            return self.by_id(int(name[3:]))
        found = self._by_name.get(name)
        if found is not None:
            return found
        match = _NAME_RE.match(name)
        if match:
            compute, gb, suffix = int(match.group(1)), int(match.group(2)), match.group(3) or ""
            candidates = [
                p
                for p in self.profiles
                if p.compute_slices == compute
                and p.variant.suffix == suffix
                and _close(_name_gb(p.name), gb)
            ]
            if len(candidates) == 1:
                return candidates[0]
        raise self._unknown(ref)

    def _unknown(self, ref: str) -> UnknownProfile:
        valid = ", ".join(f"{p.name} (id {p.profile_id})" for p in self.profiles)
        return UnknownProfile(
            f"{self.model} has no MIG profile {ref!r}",
            hint=f"valid profiles: {valid}",
            model=self.model,
            profile=ref,
        )

    def profile_set(self, spec: str | Sequence[str] = "standard") -> tuple[Profile, ...]:
        """Resolve a profile-set option to the profiles the state machine is built over.

        * ``standard`` (default): every base profile, including the 1g profile with
          two memory slices: what jobs are given.
        * ``classic``: ``standard`` without the double-memory 1g profile, i.e. the
          A100 set of the papers (1g, 2g, 3g, 4g, 7g); [Siavashi], [MIG-HT] and
          [Villarrubia] use it.
        * ``media``: ``standard`` plus the ``+me`` profiles (one OFA per GPU).
        * ``all``: every profile the model has (``+me.all``, ``-me``, ``+gfx`` too).
        * a comma-separated string or list of profile names/IDs.

        Raises:
            UnknownProfile: a listed profile does not exist on this model.
        """
        if isinstance(spec, str) and spec in ("standard", "classic", "media", "all"):
            base = [p for p in self.profiles if p.variant is Variant.BASE]
            if spec == "classic":
                base = [p for p in base if p.nvml_index != NVML_PROFILE_1_SLICE_REV2]
            elif spec == "media":
                base += [p for p in self.profiles if p.variant is Variant.ME]
            elif spec == "all":
                base = list(self.profiles)
            return tuple(sorted(base, key=_profile_order))
        names = [s for s in spec.split(",") if s.strip()] if isinstance(spec, str) else spec
        chosen = {self.profile(n).profile_id: self.profile(n) for n in names}
        if not chosen:
            raise UnknownProfile(f"empty profile set {spec!r}", hint="name at least one profile")
        return tuple(sorted(chosen.values(), key=_profile_order))

    @property
    def full_profile(self) -> Profile:
        """The whole-GPU profile (most units, then most compute)."""
        return max(self.profiles, key=lambda p: (p.memory_slices, p.compute_slices))

    # -- construction from NVML -------------------------------------------------------------

    @classmethod
    def from_nvml(
        cls,
        model: str,
        infos: Iterable[NvmlProfileInfo],
        placements: Mapping[int, Sequence[tuple[int, int]]],
        *,
        display_name: str = "",
        builtin: Geometry | None = None,
        memory_total_mib: int = 0,
        engines: Mapping[int, Mapping[str, int]] | None = None,
    ) -> Geometry:
        """Build a geometry from a live GPU's profile infos and possible placements.

        ``placements`` maps profile ID to ``(start, size)`` pairs as NVML returns them.
        Values NVML cannot give (the driver's default placement order, cross-profile
        caps such as A30's shared JPEG/OFA, engine budgets) come from ``builtin`` when
        the model is known; otherwise starts are tried in ascending order and all
        ``+me``/``+me.all`` profiles share one OFA (true of every published table).
        ``engines`` maps profile ID to the engine counts the GPU reports for it; they
        replace the built-in table's (a profile without an entry keeps the table's).

        A profile NVML gives no name (a v1 profile info) and the built-in table does
        not know is named as NVIDIA does: the GPU's marketed size in GB times the
        profile's share of the memory slices, rounded to the nearest GB (A100-40GB:
        40 x 1/8 = ``1g.5gb``; H200: 141 x 1/2 = ``3g.71gb``). The marketed size is
        ``memory_total_mib`` (the device's total memory, ``nvmlDeviceGetMemoryInfo``)
        rounded up to whole GiB, or, when that is not given, the full profile's memory
        rounded up, which gives the marketed size on A30, A100 and H100 but can fall
        a few GB short on larger GPUs.
        """
        known = {p.profile_id: p for p in builtin.profiles} if builtin else {}
        engines = engines or {}
        profiles: list[Profile] = []
        for info in infos:
            pls = sorted(placements.get(info.profile_id, ()))
            if not pls:
                continue  # profile exists in the enum but not on this GPU/driver
            sizes = {size for _, size in pls}
            if len(sizes) != 1:
                raise ValueError(f"{model}: profile {info.profile_id} has mixed sizes {sizes}")
            starts = tuple(start for start, _ in pls)
            prior = known.get(info.profile_id)
            name = normalize_profile_name(info.name) if info.name else ""
            if prior is not None and (not name or _NAME_RE.match(name) is None):
                name = prior.name
            order = (
                prior.default_order
                if prior is not None and sorted(prior.default_order) == list(starts)
                else starts
            )
            aliases = tuple(a for a in ((prior.name, *prior.aliases) if prior else ()) if a != name)
            profiles.append(
                Profile(
                    profile_id=info.profile_id,
                    name=name,
                    nvml_index=info.nvml_index,
                    compute_slices=info.compute_slices,
                    memory_slices=sizes.pop(),
                    memory_mib=info.memory_mib,
                    max_instances=info.max_instances,
                    starts=starts,
                    default_order=order,
                    variant=variant_for_nvml_index(info.nvml_index),
                    aliases=aliases,
                    sm_count=info.multiprocessor_count,
                    engines=engines.get(info.profile_id, prior.engines if prior else None),
                )
            )
        if not profiles:
            raise ValueError(f"{model}: NVML reported no MIG profiles with placements")
        units = max(s + p.memory_slices for p in profiles for s in p.starts)
        full = max(profiles, key=lambda p: (p.memory_slices, p.compute_slices))
        total_gb = -(-(memory_total_mib or full.memory_mib) // 1024)
        profiles = [
            p if p.name else replace(p, name=synthesized_name(p, units, total_gb)) for p in profiles
        ]
        present = {p.profile_id for p in profiles}
        if builtin is not None:
            groups = tuple(
                ExclusiveGroup(g.profile_ids & present, g.max_instances, g.reason)
                for g in builtin.exclusive_groups
                if g.profile_ids & present
            )
            budget = builtin.engine_budget
        else:
            media = frozenset(
                p.profile_id for p in profiles if p.variant in (Variant.ME, Variant.ME_ALL)
            )
            groups = (ExclusiveGroup(media, 1, "single OFA (assumed)"),) if media else ()
            budget = None
        return cls(
            model=model,
            display_name=display_name or (builtin.display_name if builtin else model),
            units=units,
            compute_slices=full.compute_slices,
            memory_mib=full.memory_mib,
            profiles=tuple(sorted(profiles, key=_profile_order)),
            exclusive_groups=groups,
            engine_budget=budget,
            pci_device_ids=builtin.pci_device_ids if builtin else (),
            source="nvml",
            placement_status="from NVML possible placements",
        )


def synthesized_name(profile: Profile, units: int, total_gb: int) -> str:
    """NVIDIA's name for a profile: ``<compute>g.<GB>gb<variant>``.

    The GB figure is the marketed size times the share of memory slices, rounded to
    the nearest GB, halves up (B200: 180 x 1/8 = 22.5 -> ``1g.23gb``).
    """
    gb = math.floor(total_gb * profile.memory_slices / units + 0.5)
    return f"{profile.compute_slices}g.{gb}gb{profile.variant.suffix}"


def _profile_order(p: Profile) -> tuple[int, int, int, str]:
    return (p.memory_slices, p.compute_slices, list(Variant).index(p.variant), p.name)


def _name_gb(name: str) -> int:
    match = _NAME_RE.match(name)
    return int(match.group(2)) if match else -1


def _close(a: int, b: int) -> bool:
    """Two GB figures of one profile's name under different drivers (within 5 %)."""
    return a > 0 and b > 0 and abs(a - b) <= 0.05 * max(a, b)
