"""HTCondor's names for a GPU's shares, and which of them the startd must not hand out (pure).

migd's GPU inventory (``migctl gpu-inventory``) lists each physical GPU as ``K`` distinct
HTCondor IDs, ``GPU-s00-xxxxxxxx .. GPU-s{K-1}-xxxxxxxx``. When a GPU is out of service
(a health condition, or drained), migd gives it no new lease, but HTCondor still assigns its
shares to new jobs: on a node with healthy GPUs beside it the slot still matches, and the
first free share in sorted order is often the failed GPU's. :class:`OfflineShares` decides
when to tell the startd the GPU's shares are offline (``OFFLINE_MACHINE_RESOURCE_GPUs``, read
again at ``condor_reconfig``); the :class:`~migd.ports.StartdControl` port writes and
reconfigures.

What the startd does with the list (HTCondor 23.9, ``src/condor_startd.V6/ResAttributes.cpp``
``ReconfigOfflineDevIds``/``RefreshDevIds``; docs/htcondor-notes.md): an offline ID is not
given to a new dynamic slot; a dynamic slot that already holds one keeps it in
``AssignedGPUs`` but counts ``GPUs = 0``, so the schedd cannot reuse that claim for another
GPU job; IDs it does not know are ignored. An ID that was offline when the startd *started*
stays offline until the startd restarts, whatever later reconfigs say.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the naming half is imported by migctl, which stays light
    from migd.core.gpus import ManagedGpu

#: Shares listed per GPU when HTCondor's MIGD_SHARES_PER_GPU cannot be read: IDs the startd
#: does not know are ignored, so listing more than it has is harmless.
FALLBACK_SHARES = 128


def short_uuid(uuid: str) -> str:
    """``GPU-61342749-a9b5-...`` -> ``GPU-61342749`` (condor_gpu_discovery's default id)."""
    head, _, rest = uuid.partition("-")
    return f"{head}-{rest.split('-')[0]}" if rest else uuid


def share_id(uuid: str, n: int) -> str:
    """The ``n``-th HTCondor GPU ID of a physical GPU: ``GPU-s03-61342749``.

    The share index comes first so that the IDs sort share by share across GPUs
    (``GPU-s00-aaaa``, ``GPU-s00-bbbb``, ``GPU-s01-aaaa``, ...): HTCondor 23.9 keeps
    a slot's GPU IDs sorted and gives a new job the first free one (checked in the
    pool, docs/htcondor-notes.md (q)), so each job goes to the GPU with the fewest
    jobs, and a GPU that just became free gets the next job. With the GPU first,
    every job went to the first GPU until its shares ran out, and whole-GPU jobs
    queued there while the other GPU idled.
    """
    return f"GPU-s{n:02d}-{short_uuid(uuid).removeprefix('GPU-')}"


_SHARE_SUFFIX = re.compile(r"_s\d+$")
_SHARE_PREFIX = re.compile(r"^GPU-s\d+-")


def physical_gpu(share_id: str) -> str:
    """``GPU-s03-61342749`` -> ``GPU-61342749``: the GPU behind an advertised share ID
    (the inverse of :func:`share_id`, as the wrapper reads ``AssignedGPUs``).

    ``migctl gpu-inventory --shares K`` lists each GPU as K distinct IDs because
    HTCondor 23.x collapses repeated IDs (HTCONDOR-2678). IDs of earlier releases
    (``GPU-61342749_s3``) are still understood: a startd keeps the IDs it read at
    its start.
    """
    text = share_id.strip()
    if _SHARE_PREFIX.match(text):
        return "GPU-" + _SHARE_PREFIX.sub("", text)
    return _SHARE_SUFFIX.sub("", text)


def offline_share_ids(uuids: Iterable[str], shares: int) -> list[str]:
    """Every share ID of these GPUs, GPU by GPU."""
    return [share_id(uuid, n) for uuid in uuids for n in range(shares)]


def out_of_service(gpus: Iterable[ManagedGpu]) -> tuple[str, ...]:
    """The UUIDs of the GPUs HTCondor should not assign: migd would give them no new
    lease (a health condition, or drained). GPUs migd does not manage (mode ``off``)
    are left to the admin."""
    from migd.core.gpus import GpuMode

    return tuple(
        sorted(
            gpu.uuid
            for gpu in gpus
            if gpu.mode is not GpuMode.OFF and (gpu.draining or not gpu.health.available)
        )
    )


@dataclass
class OfflineShares:
    """Keeps the startd's offline GPUs equal to migd's out-of-service ones.

    :meth:`step` says what to write (the sorted UUIDs) or ``None``; the caller writes it
    through the port and reports with :meth:`applied` or :meth:`failed`. The first step
    after start always writes, so a file left by an earlier migd (whose conditions are gone
    with it) is corrected. A failed write is retried every ``retry_s`` while it is still
    wanted; a change is written at once.
    """

    retry_s: float = 30.0
    _written: tuple[str, ...] | None = None
    _failed: tuple[str, ...] | None = None
    _retry_at: float = 0.0

    def step(self, gpus: Iterable[ManagedGpu], mono: float) -> tuple[str, ...] | None:
        wanted = out_of_service(gpus)
        if wanted == self._written:
            return None
        if wanted == self._failed and mono < self._retry_at:
            return None
        return wanted

    def applied(self, uuids: Sequence[str]) -> None:
        self._written, self._failed = tuple(uuids), None

    def failed(self, uuids: Sequence[str], mono: float) -> None:
        self._failed, self._retry_at = tuple(uuids), mono + self.retry_s

    @property
    def written(self) -> tuple[str, ...] | None:
        """What the startd was last told (None: nothing yet since start)."""
        return self._written
