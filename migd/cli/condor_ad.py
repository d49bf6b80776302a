"""HTCondor-facing output of ``migctl``: STARTD_CRON ads and the GPU inventory.

``condor-ad`` prints one node-wide ad (merged into every slot) and, with
``--per-gpu``, one ad per GPU whose ``SlotMergeConstraint`` merges it only into
slots that were assigned a share of that GPU (for layouts with one partitionable
slot per GPU). The ``START`` expression in ``condor_config/`` uses
``MigdHealthy`` and ``MigdLargestPlaceableMB``. Every attribute is listed in
``docs/operations.md``.

``gpu-inventory`` prints what ``MACHINE_RESOURCE_INVENTORY_GPUs`` expects: the
*physical* GPUs (short UUIDs, as condor_gpu_discovery names them), independent
of the MIG layout at the moment the startd starts, each listed as ``K``
distinct shares ``GPU-xxxxxxxx_s0 .. _s{K-1}``: HTCondor 23.x collapses
repeated IDs (HTCONDOR-2678, docs/htcondor-notes.md (e)), distinct ones work.
``vram-inventory`` prints the node's GPU memory pool for
``MACHINE_RESOURCE_INVENTORY_VRAM``.
"""

from __future__ import annotations

from typing import Any


def short_uuid(uuid: str) -> str:
    """``GPU-61342749-a9b5-...`` -> ``GPU-61342749`` (condor_gpu_discovery's default id)."""
    head, _, rest = uuid.partition("-")
    return f"{head}-{rest.split('-')[0]}" if rest else uuid


def _classad_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _bool(value: bool) -> str:
    return "true" if value else "false"


def free_mib(gpu: dict[str, Any]) -> int:
    """GPU memory not held by jobs: all but busy MIG instances, or unpinned MPS memory."""
    if gpu["mode"] == "off":
        return 0
    if gpu["mode"] == "mps":
        busy = int((gpu.get("mps") or {}).get("pinned_mib", 0))
    elif gpu["mode"] == "exclusive":
        busy = gpu["memory_total_mib"] if (gpu.get("exclusive") or {}).get("lease_id") else 0
    else:
        busy = sum(i["memory_mib"] for i in gpu.get("instances", []) if i["busy"])
    return max(0, int(gpu["memory_total_mib"]) - busy)


def _usable(gpu: dict[str, Any]) -> bool:
    return bool(gpu["healthy"] and not gpu["draining"] and gpu["mode"] != "off")


def render_condor_ad(status: dict[str, Any], *, per_gpu: bool = False) -> str:
    gpus = status["gpus"]
    # A state disk that refuses writes is node-level: migd refuses new leases meanwhile.
    state_disk = status.get("state_disk") or {"ok": True, "reason": ""}
    healthy_gpus = [g for g in gpus if _usable(g)] if state_disk["ok"] else []
    queued = (status.get("queue_summary") or {}).get("length", len(status.get("queue", [])))
    largest = max(
        ((g["largest_placeable"] or {}).get("memory_mib", 0) for g in healthy_gpus), default=0
    )
    free = sum(free_mib(g) for g in healthy_gpus)
    lines = [
        f"MigdHealthy = {_bool(bool(healthy_gpus))}",
        f"MigdVersion = {_classad_str(status['daemon']['version'])}",
        f"MigdGpus = {len(gpus)}",
        f"MigdHealthyGpus = {len(healthy_gpus)}",
        f"MigdLargestPlaceableMB = {largest}",
        f"MigdFreeMB = {free}",
        f"MigdQueued = {queued}",
        f"MigdStateDiskOk = {_bool(bool(state_disk['ok']))}",
        f"MigdNodeReason = {_classad_str(state_disk['reason'])}",
        f"MigdModes = {_classad_str(','.join(sorted({g['mode'] for g in gpus})))}",
        "- migd",
    ]
    if per_gpu:
        for g in gpus:
            ok = _usable(g)
            placeable = (g["largest_placeable"] or {}) if ok else {}
            reason = g["health"] if not g["healthy"] else ("draining" if g["draining"] else "")
            if g["mode"] == "off":
                reason = reason or "not managed by migd (mode off)"
            lines += [
                # AssignedGPUs holds share IDs (GPU-xxxxxxxx_sN): match on the GPU's prefix
                f"SlotMergeConstraint = regexp({_classad_str(short_uuid(g['uuid']) + '_s')},"
                ' AssignedGPUs ?: "")',
                f"MigdGpuHealthy = {_bool(ok)}",
                f"MigdGpuMode = {_classad_str(g['mode'])}",
                f"MigdGpuModel = {_classad_str(g['model'])}",
                f"MigdGpuMemoryMB = {int(g['memory_total_mib'])}",
                f"MigdGpuFreeMB = {free_mib(g) if ok else 0}",
                f"MigdGpuLargestPlaceableMB = {placeable.get('memory_mib', 0)}",
                f"MigdGpuLargestPlaceableProfile = {_classad_str(placeable.get('profile', ''))}",
                f"MigdGpuReason = {_classad_str(reason)}",
                f"- migd_gpu{g['index']}",
            ]
    lines[-1] += " update:true"
    return "\n".join(lines) + "\n"


def render_inventory(gpus: list[dict[str, Any]], *, shares: int = 1) -> str:
    """``DetectedGPUs`` for the startd: K distinct share IDs per managed GPU."""
    ids = []
    for g in gpus:
        if g.get("mode") == "off":
            continue
        base = short_uuid(g["uuid"])
        ids += [f"{base}_s{n}" for n in range(shares)] if shares > 1 else [base]
    return f'DetectedGPUs = "{", ".join(ids)}"\n'


def render_vram_inventory(gpus: list[dict[str, Any]]) -> str:
    """``DetectedVRAM``: the GPU memory (MiB) migd can hand out on this node."""
    total = sum(int(g.get("vram_mib") or 0) for g in gpus if g.get("mode") != "off")
    return f"DetectedVRAM = {total}\n"


def gpus_for_inventory(status: dict[str, Any] | None) -> list[dict[str, Any]]:
    """GPU facts for the inventories, from migd's status or, if it is down, from NVML."""
    if status is not None:
        out = []
        for g in status["gpus"]:
            largest = max((i["memory_mib"] for i in g.get("instances", [])), default=0)
            full = g.get("full_profile_mib") or largest or g["memory_total_mib"]
            out.append({"uuid": g["uuid"], "mode": g["mode"], "vram_mib": full})
        return out
    # The startd runs inventories once at start-up; if migd is not up yet, read NVML
    # (read-only) rather than advertise no GPUs for the startd's whole lifetime.
    from migd.backends.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        gpus = []
        for info in backend.discover():
            vram = info.memory_total_mib
            if info.mig_current:
                try:
                    vram = backend.geometry(info.index).full_profile.memory_mib
                except Exception:
                    vram = info.memory_total_mib
            gpus.append(
                {"uuid": info.uuid, "mode": "mig" if info.mig_current else "mps", "vram_mib": vram}
            )
        return gpus
    finally:
        backend.close()
