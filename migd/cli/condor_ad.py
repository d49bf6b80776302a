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
distinct shares ``GPU-s00-xxxxxxxx .. GPU-s{K-1}-xxxxxxxx``, each with
condor_gpu_discovery's property ad: HTCondor 23.x collapses repeated IDs
(HTCONDOR-2678, docs/htcondor-notes.md (e)), distinct ones work.
``vram-inventory`` prints the node's GPU memory pool for
``MACHINE_RESOURCE_INVENTORY_VRAM``. ``condor-slots`` prints the slot layout with one
partitionable slot per GPU (:mod:`migd.core.condor_slots`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TextIO

from migd.core.ad_updates import AdUpdates
from migd.core.condor_shares import share_id, short_uuid
from migd.core.condor_slots import SlotGpu, render_slot_types
from migd.errors import MigdError


def _classad_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _bool(value: bool) -> str:
    return "true" if value else "false"


def free_mib(gpu: dict[str, Any]) -> int:
    """GPU memory new leases could still get on this GPU (``MigdFreeMB``).

    migd's ``placeable_mib`` (:mod:`migd.core.capacity`): memory profiles can still
    use, so it agrees with the GPU's share of ``TotalVRAM`` and is 0 on a full GPU.
    A status without it (an older daemon) falls back to the memory busy instances
    or MPS shares do not hold.
    """
    if gpu["mode"] == "off":
        return 0
    if "placeable_mib" in gpu:
        return int(gpu["placeable_mib"])
    if gpu["mode"] == "mps":
        busy = int((gpu.get("mps") or {}).get("pinned_mib", 0))
    elif gpu["mode"] == "exclusive":
        busy = gpu["memory_total_mib"] if (gpu.get("exclusive") or {}).get("lease_id") else 0
    else:
        busy = sum(i["memory_mib"] for i in gpu.get("instances", []) if i["busy"])
    return max(0, int(gpu["memory_total_mib"]) - busy)


def _usable(gpu: dict[str, Any]) -> bool:
    return bool(gpu["healthy"] and not gpu["draining"] and gpu["mode"] != "off")


def render_condor_ad(status: dict[str, Any], *, per_gpu: bool = False, update: bool = True) -> str:
    """migd's ads for the startd; ``update`` ends them with ``update:true`` (an immediate
    collector update of every slot they merge into, :mod:`migd.core.ad_updates`)."""
    gpus = status["gpus"]
    # A state disk that refuses writes is node-level: migd refuses new leases meanwhile.
    state_disk = status.get("state_disk") or {"ok": True, "reason": ""}
    healthy_gpus = [g for g in gpus if _usable(g)] if state_disk["ok"] else []
    startd = status.get("startd") or {}
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
        # An older daemon's status has no "startd": nothing to say then.
        f"MigdStartdOk = {_bool(bool(startd.get('ok', True)))}",
        f"MigdNodeReason = {_classad_str(state_disk['reason'] or startd_reason(startd))}",
        f"MigdModes = {_classad_str(','.join(sorted({g['mode'] for g in gpus})))}",
        # The access point derives MIGD_MAX_VRAM / MIGD_POOL_MODES from these (`migctl
        # pool-defaults`): what this node can ever give, whatever runs on it now.
        f"MigdMaxVRAM = {max_vram(gpus_for_inventory(status))}",
        f"MigdServes = {_classad_str(','.join(node_served_modes(gpus)))}",
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
                # AssignedGPUs holds share IDs (GPU-sNN-xxxxxxxx): match on the GPU's part
                "SlotMergeConstraint = regexp("
                + _classad_str("GPU-s[0-9]+-" + short_uuid(g["uuid"]).removeprefix("GPU-"))
                + ', AssignedGPUs ?: "")',
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
    if update:
        lines[-1] += " update:true"
    return "\n".join(lines) + "\n"


def startd_reason(startd: dict[str, Any]) -> str:
    """The startd check's findings in one line ("" when none): which knobs bypass migd."""
    problems = startd.get("problems") or []
    if not problems:
        return ""
    return "startd bypasses migd: " + "; ".join(
        f"{p['knob']} = {p['value'] if p['value'] is not None else 'undefined'}" for p in problems
    )


def share_attr(share_id: str) -> str:
    """The attribute naming a GPU ID's property ad: ``GPU-s00-ab12`` -> ``GPU_s00_ab12``.

    condor_gpu_discovery names its nested ads the same way (the ID with every
    character that may not appear in an attribute name replaced by ``_``); the 23.9
    startd stores them in slot ads as ``GPUs_<name>`` and lists those in
    ``AvailableGPUs``.
    """
    return "".join(c if c.isalnum() or c == "_" else "_" for c in share_id)


def _device_uuid(uuid: str) -> str:
    """``GPU-61342749-a9b5-...`` -> ``61342749-a9b5-...``: the starter prepends ``GPU-``."""
    return uuid[4:] if uuid.startswith("GPU-") else uuid


def _cuda_version_int(version: str) -> int | None:
    """``"12.4"`` -> ``12040`` (cuDriverGetVersion's encoding, condor_gpu_discovery's
    ``MaxSupportedVersion``)."""
    major, _, minor = version.partition(".")
    try:
        return int(major) * 1000 + int(minor or 0) * 10
    except ValueError:
        return None


def gpu_properties(gpu: dict[str, Any]) -> dict[str, str]:
    """condor_gpu_discovery ``-properties`` of one GPU, as ClassAd literals.

    ``DeviceUuid`` is the parent GPU's UUID without ``GPU-`` (the form
    condor_gpu_discovery prints), so the starter's device-hiding expression
    ``join(",",evalInEachContext(strcat("GPU-",DeviceUuid),AvailableGPUs))``
    names the GPU the job's lease is on (docs/htcondor-notes.md (q)).
    ``GlobalMemoryMb`` is the largest partition migd can give a job on it (the
    full MIG profile on a MIG GPU), so ``gpus_minimum_memory`` matches exactly
    the GPUs that can hold the job.
    """
    props = {
        "DeviceUuid": _classad_str(_device_uuid(gpu["uuid"])),
        "DeviceName": _classad_str(str(gpu.get("name") or "")),
        "GlobalMemoryMb": str(int(gpu.get("vram_mib") or 0)),
    }
    capability = gpu.get("compute_capability")
    if capability:
        props["Capability"] = str(capability)
    cuda = str(gpu.get("cuda_version") or "")
    cuda_int = _cuda_version_int(cuda) if cuda else None
    if cuda_int is not None:
        # condor_gpu_discovery: DriverVersion is the CUDA driver API version as
        # major.minor, MaxSupportedVersion the same as an integer (gpus_minimum_runtime).
        props["DriverVersion"] = f"{cuda_int // 1000}.{cuda_int % 1000 // 10}"
        props["MaxSupportedVersion"] = str(cuda_int)
    if gpu.get("driver_version"):
        # No MigdDriverVersion: no matcher reads it, and each of the K x GPUs property ads
        # carried it to the collector on every update (``migctl status`` has it). NvidiaDriver
        # stays: condor_gpu_discovery -properties prints it since 24.5.1, and from 25.14.0 the
        # starter passes --nv to Apptainer only when the slot has GPUs_NvidiaDriver
        # (HTCONDOR-3887, singularity.cpp), so without it a container job gets no GPU.
        props["NvidiaDriver"] = _classad_str(str(gpu["driver_version"]))
    serves = served_modes(str(gpu.get("mode") or ""), bool(gpu.get("mps_in_mig")))
    if serves:
        # What +MigdMode a job may ask of this GPU: the access point's transform turns a
        # job's MigdMode into a require_gpus term on it, so HTCondor assigns a share of a
        # GPU that serves the mode (docs/wrapper.md, "Job shapes").
        props["MigdServes"] = _classad_str(",".join(serves))
    return props


def served_modes(mode: str, mps_in_mig: bool = False) -> tuple[str, ...]:
    """The explicit ``+MigdMode`` values a GPU in ``mode`` serves (``auto`` is served by
    every managed GPU), as the scheduler's mode drivers decide (``serves``)."""
    if mode == "mig":
        return ("mig", "mps") if mps_in_mig else ("mig",)
    if mode == "mps":
        return ("mps",)
    return ()


def node_served_modes(gpus: list[dict[str, Any]]) -> list[str]:
    """Every explicit ``+MigdMode`` some managed GPU of the node serves, sorted."""
    return sorted(
        {m for g in gpus for m in served_modes(str(g["mode"]), bool(g.get("mps_in_mig")))}
    )


def render_unavailable(message: str, *, update: bool = True) -> str:
    """The ad while migd does not answer: the startd keeps a cron job's last values, so
    say unhealthy rather than leave a stale ``MigdHealthy = true``."""
    end = " update:true" if update else ""
    return f"MigdHealthy = false\nMigdHealthReason = {_classad_str(message)}\n- migd{end}\n"


def watch(
    fetch: Callable[[], dict[str, Any]],
    out: TextIO,
    *,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    per_gpu: bool = False,
    interval_s: float = 0.5,
    updates: AdUpdates | None = None,
    rounds: int | None = None,
) -> None:
    """``condor-ad --watch``: a publisher for ``STARTD_CRON_<name>_MODE = WaitForExit``.

    The startd reads a running cron job's output as it arrives and merges an ad into its
    slots at every line that starts with ``-`` (``CronJob::StdoutHandler`` in HTCondor's
    ``src/condor_utils/condor_cron_job.cpp``; docs/htcondor-notes.md (r)). So this asks
    migd for its status every ``interval_s`` and writes the ad when it differs from the
    last one written; ``updates`` (:class:`~migd.core.ad_updates.AdUpdates`) decides which
    writes end in ``update:true`` (a collector update now: a matcher-read attribute
    changed, or the keep-alive is due). A freed partition reaches the slot ad within
    ``interval_s`` plus the startd's update. ``rounds`` bounds the loop (tests); ``None``
    runs until the startd closes the pipe (``BrokenPipeError`` ends it).
    """
    if updates is None:
        updates = AdUpdates(rand=random.random)
    n = 0
    while rounds is None or n < rounds:
        n += 1
        try:
            ad = render_condor_ad(fetch(), per_gpu=per_gpu, update=False)
        except MigdError as exc:  # down, restarting, or an answer it could not give
            ad = render_unavailable(exc.message, update=False)
        publish = updates.look(ad, clock())
        if publish is not None:
            text = publish.ad
            if publish.update:
                text = text[:-1] + " update:true\n"
            out.write(text)
            out.flush()
        sleep(interval_s)


def max_vram(gpus: list[dict[str, Any]]) -> int:
    """The largest partition this node can give one job (MiB): ``MIGD_MAX_VRAM`` for a
    pool is the largest of its nodes' values."""
    return max((int(g.get("vram_mib") or 0) for g in gpus if g.get("mode") != "off"), default=0)


def render_inventory(gpus: list[dict[str, Any]], *, shares: int = 1) -> str:
    """``DetectedGPUs`` for the startd (K distinct share IDs per managed GPU, share by
    share across GPUs, see :func:`share_id`) and one nested property ad per ID, as
    ``condor_gpu_discovery -properties -nested`` prints them."""
    managed = [g for g in gpus if g.get("mode") != "off"]
    ids: list[str] = []
    props: list[str] = []
    for n in range(shares):
        for g in managed:
            i = share_id(g["uuid"], n) if shares > 1 else short_uuid(g["uuid"])
            ids.append(i)
            body = "; ".join(f"{k}={v}" for k, v in gpu_properties(g).items())
            props.append(f'{share_attr(i)}=[ id="{i}"; {body}; ]')
    # The starter of 25.14+ reads the node-level GPUs_NvidiaDriver (the startd prefixes
    # every inventory attribute with GPUs_), as condor_gpu_discovery prints it for
    # properties all GPUs share.
    drivers = {str(g["driver_version"]) for g in managed if g.get("driver_version")}
    common = [f"NvidiaDriver={_classad_str(drivers.pop())}"] if len(drivers) == 1 else []
    return "\n".join([f'DetectedGPUs="{", ".join(ids)}"', *common, *props]) + "\n"


def render_vram_inventory(gpus: list[dict[str, Any]]) -> str:
    """``DetectedVRAM``: the GPU memory (MiB) migd can hand out on this node."""
    total = sum(int(g.get("vram_mib") or 0) for g in gpus if g.get("mode") != "off")
    return f"DetectedVRAM = {total}\n"


def render_condor_slots(gpus: list[dict[str, Any]], *, shares: int) -> str:
    """``migctl condor-slots``: one partitionable slot per GPU migd manages, each with that
    GPU's shares and its ``VRAM`` (the same GPUs and sizes as the two inventories)."""
    managed = [
        SlotGpu(uuid=str(g["uuid"]), vram_mib=int(g.get("vram_mib") or 0))
        for g in gpus
        if g.get("mode") != "off"
    ]
    return render_slot_types(managed, shares=shares)


def gpus_for_inventory(status: dict[str, Any] | None) -> list[dict[str, Any]]:
    """GPU facts for the inventories, from migd's status or, if it is down, from NVML."""
    if status is not None:
        out = []
        for g in status["gpus"]:
            largest = max((i["memory_mib"] for i in g.get("instances", [])), default=0)
            full = g.get("full_profile_mib") or largest or g["memory_total_mib"]
            out.append(
                {
                    "uuid": g["uuid"],
                    "mode": g["mode"],
                    "vram_mib": full,
                    "name": g.get("name"),
                    "compute_capability": g.get("compute_capability"),
                    "cuda_version": g.get("cuda_version"),
                    "driver_version": g.get("driver_version"),
                    "mps_in_mig": bool(g.get("mps_in_mig")),
                }
            )
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
            cap = info.compute_capability
            gpus.append(
                {
                    "uuid": info.uuid,
                    "mode": "mig" if info.mig_current else "mps",
                    "vram_mib": vram,
                    "name": info.name,
                    "compute_capability": f"{cap[0]}.{cap[1]}" if cap else None,
                    "cuda_version": info.cuda_version,
                    "driver_version": info.driver_version,
                }
            )
        return gpus
    finally:
        backend.close()
