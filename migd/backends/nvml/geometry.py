"""The GPU's MIG geometry: NVML's profiles and placements, reconciled with the built-in table.

NVML gives the profile infos (``nvidia-smi mig -lgip``) and possible placements
(``-lgipp``); values NVML cannot give (driver default order, shared caps) come from the
built-in table of the detected model (:mod:`migd.core.catalog`). The table alone stands
in where NVML cannot say (placements need root) or says nothing usable; where both
speak and differ, NVML wins and the difference is logged once.
"""

from __future__ import annotations

from collections.abc import Callable

from migd.backends.nvml.discovery import LogOnce
from migd.core import catalog
from migd.core.geometry import Geometry, NvmlProfileInfo
from migd.errors import GpuPermissionDenied, GpuUnsupported, UnknownModel
from migd.ports import GpuInfo

# Engines a profile takes from the GPU's shared pool (nvmlGpuInstanceProfileInfo_t);
# copy engines are the instance's own and are not budgeted.
SHARED_ENGINES = ("dec", "enc", "jpeg", "ofa")


def builtin_geometry(info: GpuInfo) -> Geometry | None:
    """The built-in table of the GPU's detected model, if migd has one."""
    if info.model is None:
        return None
    try:
        return catalog.geometry(info.model)
    except UnknownModel:
        return None


def from_nvml_or_table(
    gpu: int,
    info: GpuInfo,
    builtin: Geometry | None,
    profile_details: Callable[[], list[tuple[NvmlProfileInfo, dict[str, int]]]],
    read_placements: Callable[[int], list[tuple[int, int]]],
    log_once: LogOnce,
) -> Geometry:
    """The geometry of a GPU in MIG mode: NVML's profiles and placements, else the table.

    ``profile_details`` reads the profiles with their engine counts (``-lgip``),
    ``read_placements`` one profile's possible placements (``-lgipp``); ``builtin`` is the
    detected model's built-in table, if migd has one.

    Raises:
        GpuUnsupported: NVML reports no usable profiles and there is no table.
        GpuPermissionDenied: not root and there is no table.
    """
    try:
        details = profile_details()
        infos = [info for info, _engines in details]
        # NVML's own engine counts win over the table's; copy engines are not shared.
        engines = {
            info.profile_id: {k: counts[k] for k in SHARED_ENGINES if k in counts}
            for info, counts in details
        }
        placements = {
            p.profile_id: _placements_or_table(gpu, p, builtin, read_placements, log_once)
            for p in infos
        }
    except GpuPermissionDenied as err:
        if builtin is None:
            raise GpuPermissionDenied(
                f"reading the MIG placements of GPU {gpu} needs root, and migd has no "
                f"built-in table for {info.name!r}",
                gpu=gpu,
            ) from err
        log_once(f"geo-perm:{gpu}", "%s; using the built-in %s table", err, builtin.model)
        geometry = builtin
    else:
        try:
            geometry = Geometry.from_nvml(
                info.model or info.name,
                infos,
                placements,
                display_name=info.name,
                builtin=builtin,
                memory_total_mib=info.memory_total_mib,
                engines=engines,
            )
        except ValueError as exc:
            if builtin is None:
                raise GpuUnsupported(f"GPU {gpu} ({info.name}): {exc}", gpu=gpu) from exc
            log_once(
                f"geo-bad:{gpu}",
                "GPU %d: %s; using the built-in %s table",
                gpu,
                exc,
                builtin.model,
            )
            geometry = builtin
        else:
            if builtin is not None:
                _compare_with_builtin(gpu, geometry, builtin, log_once)
    return geometry


def _placements_or_table(
    gpu: int,
    info: NvmlProfileInfo,
    builtin: Geometry | None,
    read_placements: Callable[[int], list[tuple[int, int]]],
    log_once: LogOnce,
) -> list[tuple[int, int]]:
    """One profile's possible placements; the built-in table's where NVML cannot say.

    A profile NVML lists but will not give placements for (NOT_SUPPORTED) falls back
    alone; the other profiles keep NVML's. Without a table entry it is left out.
    """
    try:
        return read_placements(info.profile_id)
    except GpuUnsupported as err:
        prior = None
        if builtin is not None:
            prior = next((p for p in builtin.profiles if p.profile_id == info.profile_id), None)
        log_once(
            f"geo-profile:{gpu}:{info.profile_id}",
            "GPU %d: no placements from NVML for profile %s (%s); %s",
            gpu,
            info.name or info.profile_id,
            err.message,
            f"using the built-in {builtin.model} table's" if prior and builtin else "left out",
        )
        if prior is None:
            return []
        return [(start, prior.memory_slices) for start in prior.starts]


def _compare_with_builtin(
    gpu: int, nvml_geo: Geometry, builtin: Geometry, log_once: LogOnce
) -> None:
    """Log (once) where NVML's geometry differs from the table; NVML's is used."""
    differences, engine_differences = _differences(nvml_geo, builtin)
    if engine_differences:
        log_once(
            f"geo-engines:{gpu}",
            "GPU %d: NVML's engine counts differ from the built-in table (NVML wins): %s",
            gpu,
            "; ".join(engine_differences),
        )
    if differences:
        log_once(
            f"geo-diff:{gpu}",
            "GPU %d: NVML's MIG geometry differs from the built-in %s table (NVML wins): %s",
            gpu,
            builtin.model,
            "; ".join(differences),
        )


def _differences(nvml_geo: Geometry, builtin: Geometry) -> tuple[list[str], list[str]]:
    """Where NVML's geometry differs from the built-in table: (layout, engine counts)."""
    known = {p.profile_id: p for p in builtin.profiles}
    differences = []
    engine_differences = []
    for profile in nvml_geo.profiles:
        prior = known.get(profile.profile_id)
        if prior is None:
            differences.append(f"{profile.name} (id {profile.profile_id}) not in the table")
            continue
        if prior.engines is not None and profile.engines is not None:
            table = {k: prior.engines.get(k, 0) for k in profile.engines}
            if table != profile.engines:
                engine_differences.append(f"{profile.name}: NVML {profile.engines}, table {table}")
        if (prior.starts, prior.memory_slices, prior.max_instances) != (
            profile.starts,
            profile.memory_slices,
            profile.max_instances,
        ):
            differences.append(
                f"{profile.name}: NVML starts {profile.starts} size {profile.memory_slices} "
                f"max {profile.max_instances}, table {prior.starts} size "
                f"{prior.memory_slices} max {prior.max_instances}"
            )
    return differences, engine_differences
