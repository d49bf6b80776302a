"""Who holds the GPU's device files: the cause of a MIG destroy that fails "in use" with no
process listed.

NVML refuses to destroy an instance (``NVML_ERROR_IN_USE``) while another NVML client
holds handles to it, and such a client is no CUDA process, so NVML's process lists are
empty. DCGM's ``nv-hostengine`` does that (NVIDIA/DCGM#276, H200 with driver 580.95;
NVIDIA/go-nvml#146). What the host can show is who has ``/dev/nvidia*`` open; this module
reads that from ``/proc/<pid>/fd`` (readable for every process as root, as migd runs)
and names the known culprits, so that ``GpuBusy`` (and through it the lease's reason in
``migctl status``) says what holds the instance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")

#: Processes known to hold NVML handles without running CUDA work, and what to do.
KNOWN_HOLDERS: dict[str, str] = {
    "nv-hostengine": "DCGM's host engine holds NVML handles (NVIDIA/DCGM#276): stop DCGM "
    "(systemctl stop nvidia-dcgm) for the reconfiguration, or run it without MIG profiling",
    "dcgm-exporter": "the DCGM exporter holds NVML handles: stop it for the reconfiguration",
    "dcgmi": "a dcgmi command holds NVML handles: let it finish",
}


@dataclass(frozen=True)
class Holder:
    pid: int
    name: str


def device_file_holders(
    proc: Path = PROC, *, exclude: frozenset[int] | None = None
) -> list[Holder]:
    """Processes with a ``/dev/nvidia*`` file open (this process excluded), by pid."""
    skip = {os.getpid()} if exclude is None else set(exclude)
    found: list[Holder] = []
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        if not any(_target(fd).startswith("/dev/nvidia") for fd in fds):
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            name = "?"
        found.append(Holder(int(entry.name), name))
    return sorted(found, key=lambda h: h.pid)


def _target(fd: Path) -> str:
    try:
        return str(fd.readlink())
    except OSError:
        return ""


def describe_holders(holders: list[Holder]) -> str:
    """One sentence for an error: the known culprits first, with what to do."""
    if not holders:
        return "no process has /dev/nvidia* open besides migd (another NVML client may hold it)"
    known = [h for h in holders if h.name in KNOWN_HOLDERS]
    listed = ", ".join(f"{h.name} (pid {h.pid})" for h in holders[:8])
    more = f" and {len(holders) - 8} more" if len(holders) > 8 else ""
    text = f"processes with /dev/nvidia* open: {listed}{more}"
    if known:
        text += "; " + "; ".join(KNOWN_HOLDERS[h.name] for h in known)
    return text
