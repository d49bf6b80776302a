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

migd writes there as root, so a directory another user can write must not let them aim
that at a file of their choice: every name is opened relative to a descriptor of the
directory without following symlinks (a planted link is replaced, never written through),
files are written to a fresh temporary name then renamed, and a directory owned by
another user, or writable by group or others without the sticky bit, is refused.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path

import structlog

from migd.core.leases import LeaseState
from migd.core.scheduler import NodeScheduler
from migd.errors import ConfigError

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
            dir_fd = self._open_directory()
            try:
                self._write(dir_fd, wanted)
            finally:
                os.close(dir_fd)
        except (OSError, ConfigError) as exc:
            self._written = None  # try everything again next time
            log.warning(
                "job_mapping.write_failed",
                directory=str(self.directory),
                error=str(exc),
                hint=exc.hint
                if isinstance(exc, ConfigError) and exc.hint
                else "check metrics.dcgm_job_mapping_dir exists and is writable by migd",
            )
            return
        self._written = wanted

    def _open_directory(self) -> int:
        """A descriptor of the directory (created if missing), after checking that no other
        user can swap what migd writes there.

        Raises:
            ConfigError: the directory is a symlink, another user's, or writable by group
                or others without the sticky bit.
        """
        where = "metrics.dcgm_job_mapping_dir"
        self.directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        try:
            fd = os.open(
                self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot open {self.directory} as a directory (a symlink?): {exc.strerror}",
                where=where,
                hint="name a real directory, e.g. /run/migd/dcgm-job-map",
            ) from exc
        info = os.fstat(fd)
        problem = ""
        if info.st_uid not in (0, os.geteuid()):
            problem = f"belongs to uid {info.st_uid}, not to root or migd"
        elif info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            problem = f"is writable by others (mode {stat.S_IMODE(info.st_mode):04o}, not sticky)"
        if problem:
            os.close(fd)
            raise ConfigError(
                f"{self.directory} {problem}; refusing to write job mapping files there",
                where=where,
                hint=f"use a directory only root (or migd) can write: chmod 0755 {self.directory}",
            )
        return fd

    def _write(self, dir_fd: int, wanted: Mapping[str, str]) -> None:
        if self._written is None:  # first sync: whatever is there may be stale
            present = {n for n in os.listdir(dir_fd) if MAPPING_NAME.fullmatch(n)}
            old = dict.fromkeys(present, "")
        else:
            old = self._written
        for name in old.keys() - wanted.keys():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)  # a symlink itself, never its target
        for name, text in wanted.items():
            if old.get(name) == text and self._written is not None:
                continue
            # Write a fresh file then rename, so DCGM exporter never reads half a file and
            # a name planted as a symlink is replaced, not written through.
            tmp = f".{name}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "w") as f:
                f.write(text)
                os.fchmod(f.fileno(), 0o644)  # DCGM exporter need not run as root
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
