#!/usr/bin/env python3
"""Record what NVML reports about this node's GPUs, as JSON. READ-ONLY.

Runs migd's own :class:`~migd.backends.nvml.NvmlBackend` and records discovery,
memory, processes (with their MPS-client flag and command name) and MIG mode of
every GPU, and where MIG is on: the profile infos with engine counts (``nvidia-smi
mig -lgip``), the possible placements (``-lgipp``; root only), the existing GPU
instances with each compute instance (MIG UUID, slices) and their memory. That is
all ``SimNode.from_probe`` needs to rebuild the node, including the memory the
driver reserves on idle devices. It never creates, destroys or changes anything:
the NVML module is wrapped so that only query functions can be called at all
(:class:`ReadOnlyNvml`), and ``tests/backends/test_gpu_probe.py`` runs it on the
simulator and checks that no write call was made.

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
import subprocess
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migd.backends.nvml import NvmlBackend, nvml_errors
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


# NVML functions that change something: refused whatever their name otherwise says.
_WRITE_WORDS = re.compile(r"Create|Destroy|Set|Reset|Clear|Register|Enable|Disable|Kill|Validate")
# Queries: nvml*Get*, nvml*Is*, and the session calls.
_QUERY = re.compile(r"^nvml(Init(WithFlags)?(_v\d)?|Shutdown|ErrorString|\w*Get\w*|\w*Is[A-Z]\w*)$")


class ReadOnlyNvml:
    """A ``pynvml`` module through which only NVML queries can be called.

    Constants, types and errors pass through; any other ``nvml*`` function (create,
    destroy, set, reset, ...) raises ``PermissionError`` before NVML sees it.
    """

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    @staticmethod
    def allowed(name: str) -> bool:
        return _QUERY.match(name) is not None and _WRITE_WORDS.search(name) is None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if name.startswith("nvml") and callable(value) and not self.allowed(name):
            raise PermissionError(f"gpu_probe is read-only: it never calls {name}")
        return value

    def __dir__(self) -> list[str]:
        return dir(self._nvml)


def _command_name(pid: int) -> str | None:
    """The process's command name (``/proc/PID/comm``), e.g. nvidia-cuda-mps-server."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or None
    except OSError:
        return None


def _no_name(pid: int) -> str | None:
    return None


def probe(
    backend: NvmlBackend,
    gpus: Sequence[int] | None = None,
    *,
    simulated: str | None = None,
    command_name: Callable[[int], str | None] | None = None,
) -> dict[str, Any]:
    """Everything the backend can read about the GPUs, as a JSON-ready dict.

    ``simulated`` names the simulated node probed (recorded, so nobody mistakes the
    output for hardware). ``command_name`` looks up a process's command name; by
    default this host's ``/proc`` for a real node and nothing for a simulated one
    (its PIDs are not this host's). Tests pass their own, so the record does not
    depend on which PIDs happen to exist where the tests run.

    Raises:
        DriverUnavailable: NVML cannot be initialised (no driver or library).
    """
    lookup = command_name or (_command_name if simulated is None else _no_name)
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
        record["gpus"].append(_probe_gpu(backend, info, lookup))
    return record


def _probe_gpu(
    backend: NvmlBackend, info: GpuInfo, command_name: Callable[[int], str | None]
) -> dict[str, Any]:
    index = info.index
    errors: dict[str, str] = {}
    if info.mig_mode_error is not None:
        errors["mig_mode"] = info.mig_mode_error
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
        "persistence_mode": info.persistence_mode,
        "compute_mode": info.compute_mode,
    }
    memory = _attempt(errors, "memory", lambda: backend.memory(index))
    entry["memory_used_mib"] = memory.used_mib if memory else None
    processes = _attempt(errors, "processes", lambda: backend.processes(index))
    entry["processes"] = [
        {
            "pid": p.pid,
            "used_mib": p.used_mib,
            "mig_uuid": p.mig_uuid,
            "mps": p.mps,  # listed as an MPS client (the MPS server itself is not)
            "name": command_name(p.pid),
        }
        for p in processes or []
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
            "compute_instances": [
                {"ci_id": c.ci_id, "uuid": c.uuid, "slices": c.slices}
                for c in inst.compute_instances
            ],
        }
        if inst.uuid is not None:
            mem = _attempt(
                errors, f"memory[{inst.uuid}]", partial(backend.memory, index, inst.uuid)
            )
            item["memory_used_mib"] = mem.used_mib if mem else None
            # NVML's total for the MIG device, next to the profile's nominal size.
            item["memory_total_nvml_mib"] = mem.total_mib if mem else None
            procs = _attempt(
                errors, f"processes[{inst.uuid}]", partial(backend.processes, index, inst.uuid)
            )
            item["processes"] = [
                {"pid": p.pid, "used_mib": p.used_mib, "mps": p.mps} for p in procs or []
            ]
        item.update(_raw_gi(backend, index, inst, errors))
        instances.append(item)
    return {"profiles": profiles, "instances": instances}


def _raw_gi(backend: NvmlBackend, index: int, inst: Any, errors: dict[str, str]) -> dict[str, Any]:
    """What only raw NVML queries show about one GPU instance (read-only calls):

    * ``ci_profiles``: every compute instance profile index (``NVML_COMPUTE_INSTANCE_
      PROFILE_*``, REV1 included) with the id, slices, count and name the driver answers:
      whether REV1 repeats the 1-slice profile's id (docs/nvml.md);
    * ``ci_info_device``: whether ``nvmlComputeInstanceInfo_t.device`` is the ``parent``
      GPU (nvml.h) or the ``mig`` device on this driver.
    """
    nvml = backend.nvml
    out: dict[str, Any] = {}
    what = f"raw[{inst.gi_id}]"
    try:
        with nvml_errors("read a GPU instance", gpu=index):
            gi = nvml.nvmlDeviceGetGpuInstanceById(
                nvml.nvmlDeviceGetHandleByIndex(index), inst.gi_id
            )
    except MigdError as err:
        errors[what] = f"{type(err).__name__}: {err.message}"
        return out
    profiles = []
    indices = sorted(
        (int(getattr(nvml, n)), n)
        for n in dir(nvml)
        if n.startswith("NVML_COMPUTE_INSTANCE_PROFILE_") and not n.endswith("_COUNT")
    )
    for ci_index, name in indices:
        entry: dict[str, Any] = {"index": ci_index, "constant": name}
        try:
            with nvml_errors("read a compute instance profile", gpu=index):
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, ci_index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            entry.update(
                id=int(info.id),
                slice_count=int(info.sliceCount),
                instance_count=int(info.instanceCount),
                name=_text(getattr(info, "name", "")) or None,
            )
        except MigdError as err:
            entry["error"] = err.details.get("nvml_error")
        profiles.append(entry)
    out["ci_profiles"] = profiles
    if inst.ci_id is not None:
        try:
            with nvml_errors("read a compute instance", gpu=index):
                ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, inst.ci_id)
                device = nvml.nvmlComputeInstanceGetInfo(ci).device
                is_mig = nvml.nvmlDeviceIsMigDeviceHandle(device)
            out["ci_info_device"] = "mig" if int(getattr(is_mig, "value", is_mig)) else "parent"
        except MigdError as err:
            errors[f"{what}.ci_info_device"] = f"{type(err).__name__}: {err.message}"
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
    parser.add_argument(
        "--also-unprivileged",
        metavar="USER",
        nargs="?",
        const="nobody",
        help="run as root, then probe again as USER (default nobody), recorded under "
        '"unprivileged": what NVML refuses a normal user',
    )
    args = parser.parse_args(argv)
    node = None
    if args.simulate:
        from migd.backends.simulated import FakePynvml, SimNode

        node = SimNode.from_description(args.simulate)
        nvml = FakePynvml(node)
    if nvml is None:
        try:
            import pynvml
        except ImportError:
            print("gpu_probe: the NVML bindings (nvidia-ml-py) are not installed", file=sys.stderr)
            return 2
        nvml = pynvml
    backend = NvmlBackend(ReadOnlyNvml(nvml))
    try:
        record = probe(backend, args.gpu, simulated=args.simulate)
    except MigdError as err:
        print(f"gpu_probe: {err}", file=sys.stderr)
        return 2
    finally:
        backend.close()
    if args.also_unprivileged:
        record["unprivileged"] = _unprivileged(args, node, nvml)
    text = to_json(record)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _unprivileged(args: argparse.Namespace, node: Any, nvml: Any) -> dict[str, Any]:
    """The same probe as a normal user: in-process on a simulated node, else this script
    run again as ``args.also_unprivileged`` (it must be able to read the checkout)."""
    if node is not None:
        node.set_root(False)
        backend = NvmlBackend(ReadOnlyNvml(nvml))
        try:
            record = probe(backend, args.gpu, simulated=args.simulate)
        finally:
            backend.close()
        record["is_root"] = False
        return record
    if os.geteuid() != 0:
        return {"error": "--also-unprivileged needs root (it switches to the user)"}
    argv = [sys.executable, str(Path(__file__).resolve())]
    for gpu in args.gpu or []:
        argv += ["--gpu", str(gpu)]
    done = subprocess.run(
        argv, user=args.also_unprivileged, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip() or f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
