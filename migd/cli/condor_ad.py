"""HTCondor-facing output of ``migctl``: STARTD_CRON ads and the GPU inventory.

``condor-ad`` prints one node-wide ad (merged into every slot) and, unless
``--node-only``, one ad per GPU whose ``SlotMergeConstraint`` merges it only
into slots that were assigned that GPU, so a per-GPU partitionable slot sees
its own GPU's numbers. The ``START`` expression in ``condor_config/`` uses
``MigdHealthy`` and ``MigdLargestPlaceableMB``.

``gpu-inventory`` prints what ``MACHINE_RESOURCE_INVENTORY_GPUs`` expects:
the *physical* GPUs (short UUIDs, as condor_gpu_discovery names them),
independent of the MIG layout at the moment the startd starts.
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


def render_condor_ad(status: dict[str, Any], *, per_gpu: bool = True) -> str:
    gpus = status["gpus"]
    healthy_gpus = [g for g in gpus if g["healthy"] and not g["draining"] and g["mode"] != "off"]
    largest = max(
        ((g["largest_placeable"] or {}).get("memory_mib", 0) for g in healthy_gpus), default=0
    )
    free = 0
    for g in healthy_gpus:
        busy = sum(i["memory_mib"] for i in g.get("instances", []) if i["busy"])
        if g["mode"] == "mps":
            busy = (g.get("mps") or {}).get("pinned_mib", 0)
        free += max(0, g["memory_total_mib"] - busy)
    lines = [
        f"MigdHealthy = {_bool(bool(healthy_gpus))}",
        f"MigdVersion = {_classad_str(status['daemon']['version'])}",
        f"MigdGpus = {len(gpus)}",
        f"MigdHealthyGpus = {len(healthy_gpus)}",
        f"MigdLargestPlaceableMB = {largest}",
        f"MigdFreeMB = {free}",
        f"MigdQueued = {len(status.get('queue', []))}",
        f"MigdModes = {_classad_str(','.join(sorted({g['mode'] for g in gpus})))}",
        "- migd",
    ]
    if per_gpu:
        for g in gpus:
            placeable = (g["largest_placeable"] or {}).get("memory_mib", 0)
            ok = g["healthy"] and not g["draining"] and g["mode"] != "off"
            reason = g["health"] if not g["healthy"] else ("draining" if g["draining"] else "")
            lines += [
                f"SlotMergeConstraint = StringListIMember({_classad_str(short_uuid(g['uuid']))},"
                " AssignedGPUs)",
                f"MigdGpuHealthy = {_bool(ok)}",
                f"MigdGpuMode = {_classad_str(g['mode'])}",
                f"MigdGpuModel = {_classad_str(g['model'])}",
                f"MigdGpuLargestPlaceableMB = {placeable if ok else 0}",
                f"MigdGpuReason = {_classad_str(reason)}",
                f"- migd_gpu{g['index']}",
            ]
    lines[-1] += " update:true"
    return "\n".join(lines) + "\n"


def render_inventory(status: dict[str, Any], *, repeat: int = 1) -> str:
    ids = []
    for g in status["gpus"]:
        if g["mode"] == "off":
            continue
        ids += [short_uuid(g["uuid"])] * max(1, repeat)
    return f'DetectedGPUs = "{", ".join(ids)}"\n'
