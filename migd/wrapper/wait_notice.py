"""Telling a job that it waits inside migd for its partition.

HTCondor shows a job as ``Running`` from the moment the wrapper starts; a job matched
on an ad a little older than migd's state may then wait inside migd (seen: 22-70 s)
with nothing anywhere saying so. After ``wait_notice_s`` the wrapper says it once, on
the job's stderr and in its job ad (``MigdWaitingSince``, ``MigdWaitReason``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any


class WaitNotice:
    """Calls ``announce(started_wall)`` once if still waiting after ``after_s`` seconds.

    Used as a context manager around the blocking lease call; ``fired`` says whether it
    spoke (then the caller says when the wait ended).
    """

    def __init__(self, after_s: float, announce: Callable[[float], None]) -> None:
        self.after_s = after_s
        self.announce = announce
        self.started_wall = time.time()
        self.started = time.monotonic()
        self.fired = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> WaitNotice:
        if self.after_s > 0:
            self._timer = threading.Timer(self.after_s, self._fire)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join(timeout=5.0)  # a chirp that hangs must not hold a stop up

    def _fire(self) -> None:
        self.fired = True
        self.announce(self.started_wall)

    def waited_s(self) -> float:
        return time.monotonic() - self.started


def wait_reason(status: Mapping[str, Any], job_id: str, memory_mib: int, gpus: Any) -> str:
    """Why the job waits, in words, from migd's status (its queue head, its GPUs)."""
    return _queue_reason(status, job_id, memory_mib, gpus) + stranded_note(status, memory_mib, gpus)


def _queue_reason(status: Mapping[str, Any], job_id: str, memory_mib: int, gpus: Any) -> str:
    where = f" on GPU {', '.join(map(str, gpus))} (the one HTCondor assigned)" if gpus else ""
    queue = status.get("queue") or []
    summary = status.get("queue_summary") or {}
    for entry in queue if isinstance(queue, list) else []:
        if isinstance(entry, dict) and entry.get("job_id") == job_id:
            length = summary.get("length") if isinstance(summary, dict) else None
            of = f" of {length}" if isinstance(length, int) else ""
            return (
                f"no free partition of {memory_mib} MiB{where}: position "
                f"{entry.get('position')}{of} in migd's queue"
            )
    return f"no free partition of {memory_mib} MiB{where} yet (migd is making or freeing one)"


def stranded_note(status: Mapping[str, Any], memory_mib: int, gpus: Any) -> str:
    """When the job is pinned to GPUs that cannot place it while another GPU of this node
    could now: say so (HTCondor's share assignment and claim reuse put it there,
    docs/htcondor-notes.md (t)); else ''."""
    if not gpus:
        return ""
    pinned = {str(g) for g in gpus}
    could = []
    for gpu in status.get("gpus") or []:
        if not isinstance(gpu, dict) or gpu.get("healthy") is False:
            continue
        uuid, index = str(gpu.get("uuid", "")), str(gpu.get("index"))
        if any(uuid.startswith(p) or p == index for p in pinned):
            continue
        placeable = (gpu.get("largest_placeable") or {}).get("memory_mib", 0)
        if isinstance(placeable, int) and placeable >= memory_mib:
            could.append(index)
    if not could:
        return ""
    return (
        f"; GPU {', '.join(could)} of this node could serve it now, but HTCondor assigned "
        "this slot a share of the busy one (docs/htcondor-notes.md (t))"
    )
