"""DCGM exporter's HPC job mapping files, written from migd's leases.

DCGM exporter started with ``--hpc-job-mapping-dir DIR`` adds an ``hpc_job`` label to the
metrics of a GPU from the files in DIR (NVIDIA/dcgm-exporter,
``internal/pkg/transformation/hpc.go`` and its test, and the README's "How to include HPC
jobs in metric labels"):

* a file is named after DCGM's GPU id (``0``, ``1``, ...) for a whole GPU, or
  ``<gpu>.<gpu instance id>`` (``3.0``) for one MIG instance; other names are ignored;
* each line holds one job id; a file with several lines labels the GPU's metrics once per
  job (MPS shares of one device).

migd writes the files itself on every lease transition, so a site that already scrapes
DCGM sees per-job GPU use on dynamically created MIG instances without a prolog/epilog.
The GPU id written is NVML's index, which is DCGM's GPU id on a node where DCGM sees
every GPU (the usual case); the GPU instance id is NVML's GI id, which DCGM reports as
``GPU_I_ID``. Job ids are the leases' ``job_id`` (HTCondor's ``cluster.proc``).

migd owns the directory: files whose names look like mapping files but match no running
lease are removed (left over from a crash, or from before a restart).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from pathlib import Path

import structlog

from migd.core.leases import LeaseState
from migd.core.scheduler import NodeScheduler

log = structlog.get_logger("migd.job_mapping")

#: The names DCGM exporter reads (hpc.go's getGPUFiles: digits, or digits.digits).
MAPPING_NAME = re.compile(r"\d+(\.\d+)?")


def job_mapping(sched: NodeScheduler) -> dict[str, list[str]]:
    """File name -> job ids for every active lease (ids in lease creation order)."""
    out: dict[str, list[str]] = {}
    leases = sorted(
        (lease for lease in sched.leases.values() if lease.state is LeaseState.ACTIVE),
        key=lambda lease: (lease.created_s, lease.lease_id),
    )
    for lease in leases:
        if lease.gpu is None or lease.gpu not in sched.gpus:
            continue
        gpu = sched.gpus[lease.gpu]
        inst = gpu.instance_of(lease.lease_id)
        if inst is None and lease.mig_uuid:  # an MPS share inside a MIG instance
            inst = next((i for i in gpu.instances if i.uuid == lease.mig_uuid), None)
        name = str(gpu.index)
        if inst is not None and inst.gi_id is not None:
            name = f"{gpu.index}.{inst.gi_id}"
        jobs = out.setdefault(name, [])
        if lease.request.job_id not in jobs:
            jobs.append(lease.request.job_id)
    return out


class JobMappingWriter:
    """Keeps DIR's files equal to :func:`job_mapping` (writes only what changed)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._written: dict[str, str] | None = None  # None: not synced since start-up

    def sync(self, mapping: Mapping[str, list[str]]) -> None:
        """Write the mapping; a failure is logged, never raised (metrics must not stop
        leases)."""
        wanted = {name: "".join(f"{job}\n" for job in jobs) for name, jobs in mapping.items()}
        if wanted == self._written:
            return
        try:
            self._write(wanted)
        except OSError as exc:
            self._written = None  # try everything again next time
            log.warning(
                "job_mapping.write_failed",
                directory=str(self.directory),
                error=str(exc),
                hint="check metrics.dcgm_job_mapping_dir exists and is writable by migd",
            )
            return
        self._written = wanted

    def _write(self, wanted: Mapping[str, str]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._written is None:  # first sync: whatever is there may be stale
            present = {p.name for p in self.directory.iterdir() if MAPPING_NAME.fullmatch(p.name)}
            old = dict.fromkeys(present, "")
        else:
            old = self._written
        for name in old.keys() - wanted.keys():
            with contextlib.suppress(FileNotFoundError):
                (self.directory / name).unlink()
        for name, text in wanted.items():
            if old.get(name) == text and self._written is not None:
                continue
            # Write then rename, so DCGM exporter never reads half a file.
            tmp = self.directory / f".{name}.tmp"
            tmp.write_text(text)
            tmp.chmod(0o644)
            tmp.replace(self.directory / name)
