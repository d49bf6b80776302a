"""``migd-release-hook``: HTCondor's JOB_EXIT hook, the second line of lease release.

HTCondor runs it on every way a job leaves the slot (``exit``, ``remove``,
``hold``, ``evict``; argv[1]) with the job ad on stdin, as the job's user. It
asks migd to release every lease of that job in that slot: leases are named after
the ``GlobalJobId``, because ``ClusterId.ProcId`` repeats across access points.
It must never delay or fail the starter: whatever happens it exits 0 within a
few seconds (the starter waits at most ``<Keyword>_HOOK_JOB_EXIT_TIMEOUT``, 30 s
by default). migd's reaper is the third line, for when even this does not run.
"""

from __future__ import annotations

import os
import re
import sys

from migd.client import MigdClient
from migd.errors import MigdError

_ATTR = re.compile(r"^\s*(ClusterId|ProcId|GlobalJobId|RemoteHost)\s*=\s*(.+?)\s*$", re.MULTILINE)


def job_id_from_ad_text(text: str) -> str | None:
    """The job's ``GlobalJobId`` (what the wrapper names its leases after), else
    ``ClusterId.ProcId``, from a job ad in the old ClassAd text form.

    A tiny parser on purpose: the hook must work even where the bindings fail to load.
    """
    found = _attrs(text)
    if found.get("GlobalJobId"):
        return found["GlobalJobId"]
    if found.get("ClusterId", "").isdigit() and found.get("ProcId", "").isdigit():
        return f"{found['ClusterId']}.{found['ProcId']}"
    return None


def slot_from_ad_text(text: str) -> str:
    """The slot the job ran in (``RemoteHost = "slot1_1@node"``), or ``""``."""
    return _attrs(text).get("RemoteHost", "")


def _attrs(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip().strip('"') for m in _ATTR.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    how = args[0] if args else "exit"
    try:
        text = sys.stdin.read(1 << 20)
    except (OSError, ValueError):
        text = ""
    job_id = job_id_from_ad_text(text)
    if job_id is None:
        print(
            "migd-release-hook: no job id in the ad on stdin; nothing to release", file=sys.stderr
        )
        return 0
    try:
        # The slot narrows it: the same job id on another slot is another run's lease.
        result = MigdClient(os.environ.get("MIGD_API_SOCKET"), timeout_s=10.0).call(
            "release_job",
            job_id=job_id,
            slot=slot_from_ad_text(text),
            reason=f"JOB_EXIT hook ({how})",
        )
    except MigdError as exc:
        print(f"migd-release-hook: {exc.message}", file=sys.stderr)
        return 0
    released = result.get("released") or []
    if released:
        print(f"migd-release-hook: released {', '.join(released)} ({how})", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
