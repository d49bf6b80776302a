"""Descriptions of a simulated node: what GPUs it has and what runs on them.

Three sources, one result (a list of :class:`SimGpuSpec` plus node options):

* a short description, ``"8xA100-40GB"`` or ``"2xA100-40GB,1xH100-80GB,1xV100-32GB"``;
  an item may carry a MIG-mode flag: ``"1xA100-40GB:mig=off"``, ``":mig=pending"``
  (enable pending a reset) or ``":mig=disabling"`` (on now, off after a reset);
* a TOML document (file or text)::

      seed = 7                      # node options: seed, time_scale, root,
      time_scale = 0.0              # driver_version, cuda_version
      latency = {1 = [0.16, 0.20], 7 = [0.24, 0.22]}   # optional, every GPU: seconds
                                    # to [create, destroy] by compute slices (a size not
                                    # listed takes the next larger); default [Villarrubia]
                                    # Table 1; a [[gpu]] table may give its own
      [[gpu]]
      model = "A100-40GB"
      count = 1                     # optional, default 1
      mig = true                    # current MIG mode (default on for MIG models)
      mig_pending = true            # optional, default = mig
      instances = [["3g.20gb", 4], {profile = "1g.5gb", start = 0}]
      processes = [{pid = 4242, device = "3g.20gb@4", used_mib = 1024,
                    mps_pinned_limit_mib = 2048}]

  An instance table may also give ``uuid`` (its MIG UUID), ``gi_id`` and, for an
  instance made by hand, ``compute_instances = [{slices = 1, uuid = "MIG-..."}, ...]``
  (``[]``: a GPU instance without a compute instance). MIG UUIDs must be unique.

* a probe recorded on real hardware by ``scripts/gpu_probe.py`` (JSON), so the
  simulator can be made to agree with what a real GPU reported.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from migd.backends.simulated.hardware import IDLE_USED_MIB, MIG_IDLE_USED_MIB, board
from migd.core import catalog
from migd.core.geometry import Geometry, NvmlProfileInfo
from migd.errors import ConfigError

PROBE_SCHEMA = "migd-gpu-probe/1"


@dataclass(frozen=True, slots=True)
class SimInstanceSpec:
    """A GPU instance that exists when the node starts, with its compute instance(s).

    ``compute_instances`` is ``None`` for one full-size compute instance (MIG UUID
    ``uuid``), as migd makes them; otherwise ``(compute slices, MIG UUID or None)`` per
    compute instance, as an admin may make them by hand (``()``: none at all).
    """

    profile: str | int  # profile name or ID
    start: int
    uuid: str | None = None  # MIG UUID to use (a recorded one); generated when None
    gi_id: int | None = None  # GPU instance id to use (a recorded one); next free when None
    compute_instances: tuple[tuple[int, str | None], ...] | None = None


#: Compute modes by NVML value (nvml.h ``nvmlComputeMode_t``; 1, EXCLUSIVE_THREAD, is gone).
COMPUTE_MODES = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}


@dataclass(frozen=True, slots=True)
class SimProcessSpec:
    """A CUDA process already running when the node starts.

    ``device`` is ``"gpu"`` (the whole GPU, non-MIG), ``"<profile>@<start>"`` (a
    pre-existing instance of this GPU) or a MIG UUID of one.
    """

    pid: int
    device: str = "gpu"
    used_mib: int = 0
    mps_pinned_limit_mib: int | None = None
    mps: bool = False


@dataclass(frozen=True, slots=True)
class SimGpuSpec:
    """One simulated GPU: identity, geometry (``None``: no MIG), mode and initial contents."""

    name: str
    pci_device_id: int
    memory_total_mib: int
    geometry: Geometry | None = None
    model: str | None = None
    compute_capability: tuple[int, int] | None = None
    mig_current: bool = True
    mig_pending: bool | None = None  # None: same as mig_current
    instances: tuple[SimInstanceSpec, ...] = ()
    processes: tuple[SimProcessSpec, ...] = ()
    uuid: str | None = None  # generated from the node seed when None
    pci_bus_id: str | None = None
    # Seconds to create / destroy a GPU instance by compute slices, before ``time_scale``;
    # None: [Villarrubia] Table 1 for the model (:mod:`migd.core.costs`).
    latency: Mapping[int, tuple[float, float]] | None = field(default=None, hash=False)
    idle_used_mib: int = 0  # memory NVML reports used on the idle whole GPU (MIG off)
    mig_idle_used_mib: int = 0  # and on each idle GPU instance (driver reservations)
    # nvmlDeviceGetPersistenceMode: on, as `nvidia-persistenced` keeps it on a node set up
    # per docs/operations.md; a description can turn it off to see the warning.
    persistence_mode: bool = True
    # Memory total NVML reports for a MIG device of a profile (by name), where it differs
    # from the profile's nominal memorySizeMB; unknown for real GPUs until a probe records
    # it (docs/nvml.md).
    mig_memory_mib: Mapping[str, int] = field(default_factory=dict, hash=False)
    # nvmlDeviceGetComputeMode: "DEFAULT" (the driver's default), "EXCLUSIVE_PROCESS",
    # "PROHIBITED" (nvidia-smi -c).
    compute_mode: str = "DEFAULT"

    @classmethod
    def for_model(cls, model: str, **overrides: Any) -> SimGpuSpec:
        """A GPU of a catalog (or non-MIG table) model; ``overrides`` replace fields.

        Raises:
            ConfigError: unknown model.
        """
        facts = board(model)
        spec = cls(
            name=facts.name,
            pci_device_id=facts.pci_device_id,
            memory_total_mib=facts.memory_total_mib,
            geometry=facts.geometry,
            model=facts.model,
            compute_capability=facts.compute_capability,
            mig_current=facts.geometry is not None,
            idle_used_mib=facts.idle_used_mib,
            mig_idle_used_mib=facts.mig_idle_used_mib,
        )
        return replace(spec, **overrides) if overrides else spec


@dataclass(frozen=True)
class NodeSpec:
    """GPUs plus node options (``seed``, ``time_scale``, ``root``, versions) from a source."""

    gpus: tuple[SimGpuSpec, ...]
    options: Mapping[str, Any] = field(default_factory=dict)


_NODE_OPTIONS = ("seed", "time_scale", "root", "driver_version", "cuda_version")


def parse_source(source: str | Path) -> NodeSpec:
    """Parse a description string, TOML text, a TOML file or a probe JSON file.

    Raises:
        ConfigError: the source is malformed (``where`` says which part).
    """
    if isinstance(source, Path) or _looks_like_path(source):
        path = Path(source)
        if path.suffix == ".json":
            return parse_probe(read_json(path), where=str(path))
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc}", where="description") from exc
        return parse_toml(text, where=str(path))
    if "\n" in source or "=" in source.split(":", 1)[0] or source.lstrip().startswith("["):
        return parse_toml(source, where="description")
    return parse_description(source)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``.

    Raises:
        ConfigError: unreadable, not JSON, or not an object.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path} as JSON: {exc}", where=str(path)) from exc
    if not isinstance(data, dict):
        raise ConfigError("a probe record is a JSON object", where=str(path))
    return data


def _looks_like_path(text: str) -> bool:
    return text.endswith((".toml", ".json")) and "\n" not in text


def parse_description(text: str) -> NodeSpec:
    """``"2xA100-40GB,1xV100-32GB"`` -> GPU specs in that order.

    Raises:
        ConfigError: an item is not ``[N x]MODEL[:mig=on|off|pending|disabling]``.
    """
    gpus: list[SimGpuSpec] = []
    for position, raw in enumerate(item.strip() for item in text.split(",")):
        if not raw:
            continue
        where = f"description[{position}]"
        head, _, flags = raw.partition(":")
        count_text, sep, model = head.partition("x")
        if not sep or not count_text.strip().isdigit():
            count_text, model = "1", head
        count = int(count_text)
        if count < 1:
            raise ConfigError(f"GPU count must be at least 1 in {raw!r}", where=where)
        spec = SimGpuSpec.for_model(model.strip())
        for flag in (f.strip() for f in flags.split(":") if f.strip()):
            spec = _apply_mig_flag(spec, flag, where)
        gpus.extend([spec] * count)
    if not gpus:
        raise ConfigError(
            "the description names no GPU",
            where="description",
            hint='write e.g. "8xA100-40GB" or "2xA100-40GB,1xV100-32GB"',
        )
    return NodeSpec(tuple(gpus))


def _apply_mig_flag(spec: SimGpuSpec, flag: str, where: str) -> SimGpuSpec:
    modes = {
        "mig=on": (True, True),
        "mig=off": (False, False),
        "mig=pending": (False, True),  # enabled, waiting for a GPU reset
        "mig=disabling": (True, False),  # disabled, waiting for a GPU reset
    }
    if flag not in modes:
        raise ConfigError(f"unknown flag {flag!r}", where=where, hint="flags: " + ", ".join(modes))
    if spec.geometry is None:
        raise ConfigError(f"{spec.name} has no MIG; {flag!r} does not apply", where=where)
    current, pending = modes[flag]
    return replace(spec, mig_current=current, mig_pending=pending)


def parse_toml(text: str, *, where: str = "description") -> NodeSpec:
    """Parse the TOML form (see the module docstring).

    Raises:
        ConfigError: invalid TOML or an invalid entry.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", where=where) from exc
    options = {k: data[k] for k in _NODE_OPTIONS if k in data}
    unknown = set(data) - set(_NODE_OPTIONS) - {"gpu", "latency"}
    if unknown:
        raise ConfigError(
            f"unknown keys {sorted(unknown)}",
            where=where,
            hint="top-level keys: " + ", ".join((*_NODE_OPTIONS, "latency", "gpu")),
        )
    latency = _latency(data["latency"], f"{where}: latency") if "latency" in data else None
    gpus: list[SimGpuSpec] = []
    for position, entry in enumerate(data.get("gpu", [])):
        for spec in _gpu_from_table(entry, f"{where}: gpu[{position}]"):
            gpus.append(spec if spec.latency is not None else replace(spec, latency=latency))
    if not gpus:
        raise ConfigError("no [[gpu]] table", where=where)
    return NodeSpec(tuple(gpus), options)


def _gpu_from_table(entry: Mapping[str, Any], where: str) -> list[SimGpuSpec]:
    allowed = {
        "model",
        "count",
        "mig",
        "mig_pending",
        "instances",
        "processes",
        "uuid",
        "name",
        "memory_total_mib",
        "latency",
        "idle_used_mib",
        "mig_idle_used_mib",
        "persistence_mode",
        "compute_mode",
        "mig_memory_mib",
    }
    unknown = set(entry) - allowed
    if unknown:
        raise ConfigError(
            f"unknown keys {sorted(unknown)}",
            where=where,
            hint="keys: " + ", ".join(sorted(allowed)),
        )
    if "model" not in entry:
        raise ConfigError("missing 'model'", where=where)
    spec = SimGpuSpec.for_model(str(entry["model"]))
    overrides: dict[str, Any] = {}
    if "name" in entry:
        overrides["name"] = str(entry["name"])
    if "memory_total_mib" in entry:
        overrides["memory_total_mib"] = int(entry["memory_total_mib"])
    if "mig" in entry:
        if spec.geometry is None and entry["mig"]:
            raise ConfigError(f"{spec.name} has no MIG", where=f"{where}.mig")
        overrides["mig_current"] = bool(entry["mig"])
    if "mig_pending" in entry:
        overrides["mig_pending"] = bool(entry["mig_pending"])
    if "latency" in entry:
        overrides["latency"] = _latency(entry["latency"], f"{where}.latency")
    for key in ("idle_used_mib", "mig_idle_used_mib"):
        if key in entry:
            value = entry[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(
                    f"{key} must be a whole number of MiB >= 0", where=f"{where}.{key}"
                )
            overrides[key] = value
    if "mig_memory_mib" in entry:
        table = entry["mig_memory_mib"]
        if not isinstance(table, Mapping) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in table.values()
        ):
            raise ConfigError(
                "mig_memory_mib maps profile names to MiB > 0",
                where=f"{where}.mig_memory_mib",
            )
        overrides["mig_memory_mib"] = {str(k): int(v) for k, v in table.items()}
    if "persistence_mode" in entry:
        overrides["persistence_mode"] = bool(entry["persistence_mode"])
    if "compute_mode" in entry:
        mode = str(entry["compute_mode"]).upper()
        if mode not in COMPUTE_MODES:
            raise ConfigError(
                f"unknown compute_mode {entry['compute_mode']!r}",
                where=f"{where}.compute_mode",
                hint="one of " + ", ".join(COMPUTE_MODES),
            )
        overrides["compute_mode"] = mode
    instances: list[SimInstanceSpec] = []
    for i, inst in enumerate(entry.get("instances", [])):
        if isinstance(inst, Mapping):
            computes = inst.get("compute_instances")
            instances.append(
                SimInstanceSpec(
                    inst["profile"],
                    int(inst["start"]),
                    inst.get("uuid"),
                    inst.get("gi_id"),
                    None
                    if computes is None
                    else _compute_instances(computes, f"{where}.instances[{i}]"),
                )
            )
        elif isinstance(inst, Sequence) and len(inst) == 2:
            instances.append(SimInstanceSpec(inst[0], int(inst[1])))
        else:
            raise ConfigError(
                "an instance is [profile, start] or {profile=..., start=...}",
                where=f"{where}.instances[{i}]",
            )
    processes = tuple(
        SimProcessSpec(
            pid=int(p["pid"]),
            device=str(p.get("device", "gpu")),
            used_mib=int(p.get("used_mib", 0)),
            mps_pinned_limit_mib=p.get("mps_pinned_limit_mib"),
            mps=bool(p.get("mps", p.get("mps_pinned_limit_mib") is not None)),
        )
        for p in entry.get("processes", [])
    )
    spec = replace(spec, instances=tuple(instances), processes=processes, **overrides)
    count = int(entry.get("count", 1))
    if count < 1:
        raise ConfigError("count must be at least 1", where=f"{where}.count")
    if "uuid" in entry:
        if count != 1:
            raise ConfigError("a fixed uuid needs count = 1", where=f"{where}.uuid")
        spec = replace(spec, uuid=str(entry["uuid"]))
    if count > 1 and processes:
        raise ConfigError("processes need count = 1 (PIDs are unique)", where=f"{where}.processes")
    return [spec] * count


def _latency(table: Any, where: str) -> dict[int, tuple[float, float]]:
    """``{1 = [0.16, 0.20], ...}``: compute slices -> (create, destroy) seconds."""
    hint = "write e.g. latency = {1 = [0.16, 0.20], 7 = [0.24, 0.22]} (seconds)"
    if not isinstance(table, Mapping) or not table:
        raise ConfigError(
            "latency is a table of compute slices = [create_s, destroy_s]", where=where, hint=hint
        )
    out: dict[int, tuple[float, float]] = {}
    for key, value in table.items():
        if (
            not str(key).isdigit()
            or int(key) < 1
            or not isinstance(value, Sequence)
            or len(value) != 2
            or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value
            )
        ):
            raise ConfigError(f"bad latency entry {key} = {value!r}", where=where, hint=hint)
        out[int(key)] = (float(value[0]), float(value[1]))
    return out


def _compute_instances(entries: Any, where: str) -> tuple[tuple[int, str | None], ...]:
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise ConfigError("compute_instances is a list of {slices = N, uuid = ...}", where=where)
    out: list[tuple[int, str | None]] = []
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("slices"), int):
            raise ConfigError(
                "each compute instance is {slices = N} with an optional uuid", where=where
            )
        uuid = entry.get("uuid")
        out.append((int(entry["slices"]), None if uuid is None else str(uuid)))
    return tuple(out)


def parse_probe(
    data: Mapping[str, Any], *, where: str = "probe", with_processes: bool = True
) -> NodeSpec:
    """Build specs from a ``scripts/gpu_probe.py`` record.

    Geometry comes from the recorded profile infos and possible placements
    (:meth:`Geometry.from_nvml`, with the catalog entry of the detected model for
    the values NVML cannot give); a probe without placements (run without root, or
    with MIG disabled) falls back to the catalog. Recorded instances keep their
    MIG UUIDs; recorded processes are attached to the devices they used.

    Raises:
        ConfigError: not a probe record, or a GPU without usable MIG data.
    """
    if data.get("schema") != PROBE_SCHEMA:
        raise ConfigError(
            f"not a {PROBE_SCHEMA} record (schema={data.get('schema')!r})", where=where
        )
    options: dict[str, Any] = {}
    if data.get("driver_version"):
        options["driver_version"] = str(data["driver_version"])
    if data.get("cuda_version"):
        options["cuda_version"] = str(data["cuda_version"])
    gpus: list[SimGpuSpec] = []
    for position, gpu in enumerate(data.get("gpus", [])):
        gpus.append(_gpu_from_probe(gpu, f"{where}: gpus[{position}]", with_processes))
    if not gpus:
        raise ConfigError("the probe lists no GPU", where=where)
    return NodeSpec(tuple(gpus), options)


def _gpu_from_probe(gpu: Mapping[str, Any], where: str, with_processes: bool) -> SimGpuSpec:
    model = gpu.get("model")
    builtin = catalog.builtin_models().get(model) if isinstance(model, str) else None
    mig = gpu.get("mig") or {}
    geometry: Geometry | None = None
    if gpu.get("mig_current") is not None:
        profiles = mig.get("profiles") or []
        infos = [
            NvmlProfileInfo(
                nvml_index=int(p["nvml_index"]),
                profile_id=int(p["id"]),
                compute_slices=int(p["slice_count"]),
                max_instances=int(p["instance_count"]),
                memory_mib=int(p["memory_mib"]),
                name=str(p.get("name") or ""),
                multiprocessor_count=p.get("multiprocessor_count"),
            )
            for p in profiles
        ]
        placements = {
            int(p["id"]): [(int(s), int(z)) for s, z in p["placements"]]
            for p in profiles
            if p.get("placements")
        }
        if infos and placements:
            geometry = Geometry.from_nvml(
                str(model or gpu["name"]),
                infos,
                placements,
                display_name=str(gpu["name"]),
                builtin=builtin,
                # Engine counts as recorded (NVML reports them per profile; the catalog
                # may not).
                engines={
                    int(p["id"]): {k: int(v) for k, v in p["engines"].items()}
                    for p in profiles
                    if p.get("engines")
                },
            )
        elif builtin is not None:
            geometry = builtin
        else:
            raise ConfigError(
                "MIG-capable GPU of an unknown model without recorded placements",
                where=where,
                hint="re-run scripts/gpu_probe.py as root with MIG enabled",
            )
    instances = tuple(
        SimInstanceSpec(
            int(i["profile_id"]),
            int(i["start"]),
            i.get("uuid"),
            i.get("gi_id"),
            None
            if i.get("compute_instances") is None
            # An empty UUID in a probe means none was recorded (a TOML spec refuses it).
            else tuple(
                (slices, uuid or None)
                for slices, uuid in _compute_instances(
                    i["compute_instances"], f"{where}: instances[{n}]"
                )
            ),
        )
        for n, i in enumerate(mig.get("instances") or [])
    )
    processes: tuple[SimProcessSpec, ...] = ()
    if with_processes:
        processes = tuple(
            SimProcessSpec(
                pid=int(p["pid"]),
                device=str(p.get("mig_uuid") or "gpu"),
                used_mib=int(p.get("used_mib") or 0),
                mps=bool(p.get("mps", False)),
            )
            for p in gpu.get("processes") or []
        )
    cc = gpu.get("compute_capability")
    spec = SimGpuSpec(
        name=str(gpu["name"]),
        pci_device_id=int(gpu["pci_device_id"]),
        memory_total_mib=int(gpu["memory_total_mib"]),
        geometry=geometry,
        model=str(model) if model else None,
        compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
        mig_current=bool(gpu.get("mig_current")),
        mig_pending=None if gpu.get("mig_pending") is None else bool(gpu["mig_pending"]),
        instances=instances,
        processes=processes,
        uuid=str(gpu["uuid"]) if gpu.get("uuid") else None,
        pci_bus_id=str(gpu["pci_bus_id"]) if gpu.get("pci_bus_id") else None,
    )
    found = _idle_used(gpu, mig)
    return replace(
        spec,
        idle_used_mib=found.get("idle_used_mib", IDLE_USED_MIB),
        mig_idle_used_mib=found.get("mig_idle_used_mib", MIG_IDLE_USED_MIB),
        mig_memory_mib=_mig_memory(mig, geometry),
        persistence_mode=gpu.get("persistence_mode") is not False,
        compute_mode=str(gpu.get("compute_mode") or "DEFAULT"),
    )


def _mig_memory(mig: Mapping[str, Any], geometry: Geometry | None) -> dict[str, int]:
    """MIG device memory totals NVML reported (``memory_total_nvml_mib``) where they
    differ from the profile's nominal size, by profile name."""
    if geometry is None:
        return {}
    out: dict[str, int] = {}
    for inst in mig.get("instances") or []:
        total = inst.get("memory_total_nvml_mib")
        profile = next((p for p in geometry.profiles if p.profile_id == inst["profile_id"]), None)
        if isinstance(total, int) and profile is not None and total != profile.memory_mib:
            out[profile.name] = total
    return out


def _idle_used(gpu: Mapping[str, Any], mig: Mapping[str, Any]) -> dict[str, int]:
    """What the driver held on the recorded GPU beyond its processes' memory.

    A whole GPU (MIG off): its used memory less its processes'. MIG instances: the
    least any instance held beyond its processes'. Where the record cannot say, the
    model's defaults stay (:mod:`migd.backends.simulated.hardware`).
    """
    by_device: dict[str | None, int] = {}
    for proc in gpu.get("processes") or []:
        by_device[proc.get("mig_uuid")] = by_device.get(proc.get("mig_uuid"), 0) + int(
            proc.get("used_mib") or 0
        )
    out: dict[str, int] = {}
    used = gpu.get("memory_used_mib")
    if gpu.get("mig_current") is not True and isinstance(used, int):
        out["idle_used_mib"] = max(0, used - sum(by_device.values()))
    held = [
        int(i["memory_used_mib"])
        - sum(by_device.get(c.get("uuid"), 0) for c in i.get("compute_instances") or [i])
        for i in mig.get("instances") or []
        if isinstance(i.get("memory_used_mib"), int)
    ]
    if held:
        out["mig_idle_used_mib"] = max(0, min(held))
    return out
