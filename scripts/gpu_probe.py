#!/usr/bin/env python3
"""Record what NVML reports about this node's GPUs, as JSON. READ-ONLY.

Runs migd's own :class:`~migd.backends.nvml.NvmlBackend` and records discovery,
memory, processes and MIG mode of every GPU, and where MIG is on: the profile
infos (``nvidia-smi mig -lgip``), the possible placements (``-lgipp``; root only),
the existing instances with their memory and processes. It never creates,
destroys or changes anything: only NVML *query* functions are called (the test
``tests/backends/test_gpu_probe.py`` runs it on the simulator and checks that no
write call was made).

The record feeds the simulator (``SimNode.from_probe(path)``), so tests can be
made to agree with real hardware. Usage::

    sudo .venv/bin/python scripts/gpu_probe.py -o tests/data/probe_h100.json
    .venv/bin/python scripts/gpu_probe.py --simulate 2xA100-40GB   # try it without a GPU

Run it as root to include the placements and instances (NVML restricts those
queries); without root they are recorded as errors.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migd.backends.nvml import NvmlBackend
from migd.errors import MigdError
from migd.ports import GpuInfo

PROBE_SCHEMA = "migd-gpu-probe/1"
T = TypeVar("T")


def _attempt(errors: dict[str, str], what: str, read: Callable[[], T]) -> T | None:
    """Run one read; record a migd error under ``what`` instead of failing the probe."""
    try:
        return read()
    except MigdError as err:
        errors[what] = f"{type(err).__name__}: {err.message}"
        return None


def _bindings_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:  # not installed as a distribution (e.g. the simulator)
        return None


def probe(
    backend: NvmlBackend, gpus: Sequence[int] | None = None, *, simulated: str | None = None
) -> dict[str, Any]:
    """Everything the backend can read about the GPUs, as a JSON-ready dict.

    ``simulated`` names the simulated node probed (recorded, so nobody mistakes the
    output for hardware).

    Raises:
        DriverUnavailable: NVML cannot be initialised (no driver or library).
    """
    infos = backend.discover()
    record: dict[str, Any] = {
        "schema": PROBE_SCHEMA,
        "synthetic": simulated is not None,
        "simulated": simulated,
        "recorded_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "tool": "scripts/gpu_probe.py",
        "nvidia_ml_py": None if simulated else _bindings_version(),
        "is_root": os.geteuid() == 0,
        "driver_version": infos[0].driver_version if infos else None,
        "cuda_version": infos[0].cuda_version if infos else None,
        "gpus": [],
    }
    for info in infos:
        if gpus is not None and info.index not in gpus:
            continue
        record["gpus"].append(_probe_gpu(backend, info))
    return record


def _probe_gpu(backend: NvmlBackend, info: GpuInfo) -> dict[str, Any]:
    index = info.index
    errors: dict[str, str] = {}
    entry: dict[str, Any] = {
        "index": info.index,
        "uuid": info.uuid,
        "name": info.name,
        "pci_bus_id": info.pci_bus_id,
        "pci_device_id": info.pci_device_id,
        "pci_device_id_hex": f"0x{info.pci_device_id:08X}",
        "memory_total_mib": info.memory_total_mib,
        "mig_current": info.mig_current,
        "mig_pending": info.mig_pending,
        "compute_capability": list(info.compute_capability) if info.compute_capability else None,
        "model": info.model,
    }
    memory = _attempt(errors, "memory", lambda: backend.memory(index))
    entry["memory_used_mib"] = memory.used_mib if memory else None
    processes = _attempt(errors, "processes", lambda: backend.processes(index))
    entry["processes"] = [
        {"pid": p.pid, "used_mib": p.used_mib, "mig_uuid": p.mig_uuid} for p in processes or []
    ]
    if info.mig_current:
        entry["mig"] = _probe_mig(backend, index, errors)
    entry["errors"] = errors
    return entry


def _probe_mig(backend: NvmlBackend, index: int, errors: dict[str, str]) -> dict[str, Any]:
    profiles: list[dict[str, Any]] = []
    details = (
        _attempt(errors, "profile_infos", lambda: backend.profile_infos_with_engines(index)) or []
    )
    for profile, engines in details:
        placements = _attempt(
            errors,
            f"placements[{profile.profile_id}]",
            partial(backend.possible_placements, index, profile.profile_id),
        )
        profiles.append(
            {
                "nvml_index": profile.nvml_index,
                "id": profile.profile_id,
                "name": profile.name,
                "slice_count": profile.compute_slices,
                "instance_count": profile.max_instances,
                "memory_mib": profile.memory_mib,
                "multiprocessor_count": profile.multiprocessor_count,
                "engines": engines,
                "placements": [list(p) for p in placements] if placements is not None else None,
            }
        )
    instances: list[dict[str, Any]] = []
    for inst in _attempt(errors, "instances", lambda: backend.list_instances(index)) or []:
        item: dict[str, Any] = {
            "gi_id": inst.gi_id,
            "profile_id": inst.profile_id,
            "start": inst.start,
            "size": inst.size,
            "ci_id": inst.ci_id,
            "uuid": inst.uuid,
            "memory_total_mib": inst.memory_total_mib,
        }
        if inst.uuid is not None:
            mem = _attempt(
                errors, f"memory[{inst.uuid}]", partial(backend.memory, index, inst.uuid)
            )
            item["memory_used_mib"] = mem.used_mib if mem else None
        instances.append(item)
    return {"profiles": profiles, "instances": instances}


def to_json(record: dict[str, Any]) -> str:
    """Indented JSON with short number lists (placements, versions) on one line."""
    text = json.dumps(record, indent=2)
    return re.sub(r"\[\s*(-?\d+),\s*(-?\d+)\s*\]", r"[\1, \2]", text) + "\n"


def main(argv: Sequence[str] | None = None, *, nvml: object | None = None) -> int:
    """CLI entry point; ``nvml`` replaces ``pynvml`` (tests pass the simulated one)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-o", "--output", type=Path, help="write the JSON here (default stdout)")
    parser.add_argument("--gpu", type=int, action="append", help="only this GPU (repeatable)")
    parser.add_argument(
        "--simulate",
        metavar="DESCRIPTION",
        help='probe a simulated node instead, e.g. "2xA100-40GB"',
    )
    args = parser.parse_args(argv)
    if args.simulate:
        from migd.backends.simulated import FakePynvml, SimNode

        nvml = FakePynvml(SimNode.from_description(args.simulate))
    backend = NvmlBackend(nvml)
    try:
        record = probe(backend, args.gpu, simulated=args.simulate)
    except MigdError as err:
        print(f"gpu_probe: {err}", file=sys.stderr)
        return 2
    finally:
        backend.close()
    text = to_json(record)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
