"""What a configuration means on this node: checks beyond its syntax.

:func:`migd.daemon.config.load_config` checks types and ranges. A file can pass that and
still leave a node broken: a profile name no GPU model has (every MIG GPU unhealthy), a
lease user the host does not know (no one can lease), a ``[[gpu]] match`` that matches
no GPU (the override silently never applies). These checks catch them:

* :func:`check_catalog` needs nothing but the built-in catalog (``migd/core/catalog.py``):
  every profile name must exist on at least one model migd knows;
* :func:`check_accounts` asks the host (the :class:`~migd.ports.Accounts` port) for
  every user and group ``[api]`` names;
* :func:`check_gpus` checks against the GPUs migd sees (NVML or ``--simulate``): each
  ``[[gpu]] match`` matches one, each MIG GPU has the profiles it is given.

``migd --check-config`` runs all three (the GPU one only where a GPU backend answers,
saying what it skipped otherwise). At start migd runs :func:`check_catalog` and
:func:`check_gpus`: a profile a GPU lacks stops the start (exit 2). A ``[[gpu]] match``
without a GPU and an unknown account are only logged then: a GPU that fell off the bus
or a directory service (LDAP, SSSD) not yet up at boot must not keep the other GPUs
from serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from migd.core.catalog import builtin_models
from migd.core.geometry import Geometry
from migd.daemon.config import ApiSection, MigdConfig
from migd.errors import ConfigError, MigdError
from migd.ports import Accounts, GpuInfo

#: ``policy.profiles`` values that name a set, not profiles (Geometry.profile_set).
PROFILE_SETS = ("standard", "classic", "media", "all")

#: The ``[api]`` keys that name users, and those that name groups.
USER_KEYS = ("lease_users", "admin_users", "hook_users")
GROUP_KEYS = ("lease_groups", "admin_groups")


@dataclass
class Findings:
    """What the checks found: ``errors`` make the configuration unusable (exit 2),
    ``warnings`` are worth a look, ``skipped`` says which checks could not run here."""

    errors: list[ConfigError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def extend(self, other: Findings) -> None:
        self.errors += other.errors
        self.warnings += other.warnings
        self.skipped += other.skipped


def profile_names(spec: str) -> list[str]:
    """The profile names of a ``profiles`` value (none for a named set)."""
    if spec.strip() in PROFILE_SETS:
        return []
    return [name.strip() for name in spec.split(",") if name.strip()]


def _profile_settings(config: MigdConfig) -> list[tuple[str, list[str]]]:
    """Every setting that names profiles, with the names."""
    settings = [("policy.profiles", profile_names(config.policy.profiles))]
    for i, override in enumerate(config.gpu):
        if override.profiles is not None:
            settings.append((f"gpu[{i}].profiles", profile_names(override.profiles)))
        if override.mps_profile is not None:
            settings.append((f"gpu[{i}].mps_profile", [override.mps_profile]))
    settings.append(("policy.demand_prior", list(config.policy.demand_prior)))
    return settings


def _has(geometry: Geometry, name: str) -> bool:
    try:
        geometry.profile(name)
    except MigdError:
        return False
    return True


def _valid_names(geometries: Iterable[Geometry]) -> str:
    names = sorted({p.name for g in geometries for p in g.profiles}, key=_name_order)
    return ", ".join(names)


def _name_order(name: str) -> tuple[int, int, str]:
    compute, _, rest = name.partition("g.")
    gb = rest.split("gb")[0]
    return (int(compute) if compute.isdigit() else 99, int(gb) if gb.isdigit() else 0, name)


def check_catalog(config: MigdConfig) -> Findings:
    """Every profile name in the configuration exists on at least one built-in model."""
    found = Findings()
    models = builtin_models().values()
    for where, names in _profile_settings(config):
        if where == "policy.profiles" and not names and config.policy.profiles.strip() == "":
            found.errors.append(ConfigError("names no profile", where=where))
        unknown = [n for n in names if not any(_has(g, n) for g in models)]
        if unknown:
            found.errors.append(
                ConfigError(
                    f"no GPU model migd knows has MIG profile(s) {', '.join(map(repr, unknown))}",
                    where=where,
                    hint=f"profile sets: {', '.join(PROFILE_SETS)}; profile names: "
                    f"{_valid_names(models)} (per model: `migctl states --list-models`)",
                )
            )
    return found


def check_accounts(api: ApiSection, accounts: Accounts) -> Findings:
    """Every user and group ``[api]`` names exists on this host.

    A name that is also the key's default (``condor``) is only a warning: the shipped
    file names HTCondor's account, which appears when HTCondor is installed, possibly
    after migd.
    """
    found = Findings()
    checks: list[tuple[str, str, Callable[[str], int | None]]] = [
        *((key, "user", accounts.user_id) for key in USER_KEYS),
        *((key, "group", accounts.group_id) for key in GROUP_KEYS),
    ]
    if api.socket_group is not None:
        checks.append(("socket_group", "group", accounts.group_id))
    for key, kind, lookup in checks:
        value = getattr(api, key)
        names = [value] if isinstance(value, str) else list(value)
        default = ApiSection.model_fields[key].get_default(call_default_factory=True) or []
        for name in names:
            if name == "*" or lookup(name) is not None:
                continue
            what = f"api.{key}: no {kind} {name!r} on this host"
            if name in default:
                found.warnings.append(f"{what} (is HTCondor installed?)")
                continue
            command = "getent passwd" if kind == "user" else "getent group"
            found.errors.append(
                ConfigError(
                    f"no {kind} {name!r} on this host",
                    where=f"api.{key}",
                    hint=f"`{command} {name}` must find it: fix the name, or create the "
                    f"{kind} first",
                )
            )
    return found


def _gpu_list(gpus: Sequence[GpuInfo]) -> str:
    return ", ".join(f"{g.index} ({g.model or g.name}, {g.uuid})" for g in gpus) or "none"


def check_gpus(
    config: MigdConfig,
    gpus: Sequence[GpuInfo],
    geometry_of: Callable[[int], Geometry],
    *,
    unmatched_is_error: bool = True,
) -> Findings:
    """The configuration against the GPUs migd sees.

    * each ``[[gpu]] match`` matches a GPU (the override would never apply): an error,
      or with ``unmatched_is_error=False`` (at start) a warning;
    * each GPU with MIG enabled (or pending) has every profile it is given
      (``policy.profiles``, or its ``[[gpu]] profiles`` and ``mps_profile``);
    * each ``policy.demand_prior`` name exists on one of those GPUs.

    ``geometry_of`` is :meth:`migd.ports.GpuBackend.geometry`.
    """
    found = Findings()
    for i, table in enumerate(config.gpu):
        if table.match == "*":
            continue
        if not any(_matches(table.match, g) for g in gpus):
            error = ConfigError(
                f"{table.match!r} matches no GPU on this node (GPUs: {_gpu_list(gpus)})",
                where=f"gpu[{i}].match",
                hint="use a GPU index, a UUID or UUID prefix (`nvidia-smi -L`), or * for every GPU",
            )
            if unmatched_is_error:
                found.errors.append(error)
            else:
                found.warnings.append(error.message)
    geometries: list[Geometry] = []
    for info in gpus:
        if not (info.mig_current or info.mig_pending):
            continue  # policy.profiles means nothing on a GPU without MIG
        override = config.override_for(info.index, info.uuid)
        if override is not None and override.mode in ("off", "mps", "exclusive"):
            continue
        try:
            geometry = geometry_of(info.index)
        except MigdError as exc:
            found.skipped.append(
                f"GPU {info.index} ({info.name}): profiles not checked, no MIG geometry: "
                f"{exc.message}"
            )
            continue
        geometries.append(geometry)
        spec = (override.profiles if override and override.profiles else None) or (
            config.policy.profiles
        )
        where = (
            f"gpu[{config.gpu.index(override)}].profiles"
            if override and override.profiles
            else "policy.profiles"
        )
        wanted = [(where, n) for n in profile_names(spec)]
        if override is not None and override.mps_profile is not None:
            wanted.append((f"gpu[{config.gpu.index(override)}].mps_profile", override.mps_profile))
        for setting, name in wanted:
            if not _has(geometry, name):
                found.errors.append(
                    ConfigError(
                        f"GPU {info.index} ({geometry.model}) has no MIG profile {name!r}",
                        where=setting,
                        hint=f"its profiles: {_valid_names([geometry])}; give GPUs of "
                        "different models their own `profiles` in a [[gpu]] table",
                    )
                )
    if geometries:
        for name in config.policy.demand_prior:
            if not any(_has(g, name) for g in geometries):
                found.errors.append(
                    ConfigError(
                        f"no MIG GPU on this node has profile {name!r}",
                        where="policy.demand_prior",
                        hint=f"their profiles: {_valid_names(geometries)}",
                    )
                )
    return found


def _matches(match: str, info: GpuInfo) -> bool:
    """:meth:`MigdConfig.override_for`'s rule for one GPU."""
    return match == str(info.index) or (match.startswith("GPU-") and info.uuid.startswith(match))
