"""The wrapper's own cgroup, sent with its lease request (MPS v3 per-job memory limits).

HTCondor runs each job, and its wrapper, in a cgroup of its own; on a cgroup v2 host
``/proc/self/cgroup`` has one line, ``0::/<path>``. migd may set an MPS share's memory as
that cgroup's device-memory limit (docs/mps.md, "MPS v3"), which holds every process of
the job together, ``condor_ssh_to_job`` sessions included.
"""

from __future__ import annotations

from pathlib import Path

from migd.core.mps import job_cgroup_problem

PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def own_cgroup(text: str | None = None) -> str | None:
    """The cgroup v2 path of this process (``0::`` line), or ``None`` when there is none
    to send (no ``/proc``, a v1-only host, or a path migd would refuse). Never raises."""
    if text is None:
        try:
            text = PROC_SELF_CGROUP.read_text()
        except OSError:
            return None
    for line in text.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if hierarchy == "0" and sep and not controllers:
            return path if job_cgroup_problem(path) is None else None
    return None
