"""Negotiation cycle with 20,000 idle GPU jobs: free-form requests, rounded ones, whole GPUs.

    sudo MIGD_CONDOR_ROOT=/var/tmp/migd-condor-x .venv/bin/python bench/negotiation_scale.py
    # -> bench/results/negotiation_scale.md

A real condor_negotiator, condor_collector and condor_schedd (HTCondor 23.9.6, the Debian
trixie chroot of ``tests/integration/condor_pool.py``). The execute side is simulated:
``--nodes`` partitionable slot ads are sent with ``condor_advertise`` (no startds run, so
the jobs stay idle, which is what is measured: the cycle over 20,000 idle jobs). The
advertised slots have no private ad (no claim id), so the negotiator hands out no match:
every autocluster is tried against every slot and rejected, each cycle. That is the
matchmaking scan that grows with autoclusters x idle slots, the part
rounding shrinks; with real startds, matched slots would drop out of later scans.
The ads are the pool's own startd's partitionable slot ad, renamed:

* **migd**: 8 A100-40GB as 7 shares each, the GPU memory pool ``VRAM`` and the shipped
  ``START`` (``MigdLargestPlaceableMB``...); the access point runs the shipped
  ``20-migd-access-point.config``. Jobs ask ``request_GPUs = 1`` and ``request_VRAM`` =
  the memory of the first ``--jobs`` jobs of :func:`migd.policysim.workloads.pool_stream`
  (half [Voigtlaender]'s trainings, half [MIG-HT]'s buckets: thousands of distinct sizes),
  *free-form* (``MIGD_ROUND_VRAM = false``) or *rounded* to the ladder (the default).
* **stock**: 8 whole GPUs per node, no ``VRAM``, HTCondor's own config; the same jobs ask
  ``request_GPUs = 1`` only.

Each case runs ``--cycles`` negotiation cycles after the queue is loaded; the table gives
the negotiator ad's ``LastNegotiationCycleDuration0`` (median and last) and the schedd's
autocluster count (``condor_q -autocluster``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from collector_scale import new_inventory, slot_ads  # noqa: E402

from migd.policysim.workloads import pool_stream  # noqa: E402

RESULTS = ROOT / "bench" / "results"
AP_CONFIG = (ROOT / "condor_config" / "20-migd-access-point.config").read_text()
EP_CONFIG = (ROOT / "condor_config" / "10-migd-execute.config").read_text()


def migd_start(chroot: Any) -> str:
    """The shipped START clause (MIGD_START), as HTCondor expands it from the shipped
    execute-node configuration with its defaults: it names other macros
    (``$(MIGD_PLACEABLE_MB)``), which a ClassAd cannot hold unexpanded."""
    chroot.write_file("/tmp/migd-bench/10-migd-execute.config", EP_CONFIG)
    got = chroot.run(
        ["condor_config_val", "MIGD_START"],
        env={"CONDOR_CONFIG": "/tmp/migd-bench/10-migd-execute.config"},
    )
    start = str(got.stdout).strip()
    if not start or "$(" in start:
        raise RuntimeError(f"MIGD_START did not expand to an expression: {start!r}")
    return start


def node_ads(pslot: str, nodes: int, start: str | None) -> list[str]:
    """``nodes`` copies of ``pslot`` under their own names; with ``start`` (migd's), that
    START and the attributes it reads."""
    extra = []
    migd = start is not None
    if migd:
        extra = [
            f"START = {start}",
            "MigdHealthy = true",
            "MigdLargestPlaceableMB = 40448",
        ]
    ads = []
    for i in range(nodes):
        [ad] = slot_ads(pslot, f"node{i:05d}", 0)
        if migd:  # the shipped START; Requirements = START && (WithinResourceLimits) stays
            ad = "\n".join(ln for ln in ad.splitlines() if not ln.lower().startswith("start ="))
        ads.append(ad + "\n" + "\n".join(extra))
    return ads


def run_case(
    chroot: object, label: str, pslot: str, sizes: list[int], args: argparse.Namespace
) -> dict[str, object]:
    from tests.integration.condor_pool import PersonalPool

    migd = label != "stock"
    files = {"20-migd-access-point.config": AP_CONFIG} if migd else {}
    if migd:  # the shipped default is off (docs/operations.md): each case says which
        files["21-migd-bench"] = f"MIGD_ROUND_VRAM = {str(label == 'rounded').lower()}\n"
    with PersonalPool(chroot, "negoscale") as pool:  # type: ignore[arg-type]
        pool.start(
            # the local startd takes no jobs; cycles far enough apart to be one each
            "START = False\n"
            f"NEGOTIATOR_INTERVAL = {args.interval}\nNEGOTIATOR_MIN_INTERVAL = {args.interval}\n"
            # its ad after every cycle, not every 300 s
            "NEGOTIATOR_CYCLE_DELAY = 1\nCLASSAD_LIFETIME = 3600\n"
            "NEGOTIATOR_UPDATE_INTERVAL = 5\n"
            "MAX_JOBS_SUBMITTED = 100000\nMAX_JOBS_PER_SUBMISSION = 100000\n"
            "MAX_JOBS_PER_OWNER = 100000\nSCHEDD_INTERVAL = 10\n",
            config_files=files,
        )
        from collector_scale import advertise

        advertise(chroot, node_ads(pslot, args.nodes, migd_start(chroot) if migd else None))
        jobdir = pool.new_job_dir()
        chroot.write_file(  # type: ignore[attr-defined]
            f"{jobdir}/sizes.txt", "\n".join(map(str, sizes)) + "\n", owner="migdtest"
        )
        desc = {
            "executable": "/bin/true",
            "request_GPUs": "1",
            "request_cpus": "1",
            "request_memory": "64",
        }
        if migd:
            desc["request_VRAM"] = "$(vram)"
        t0 = time.monotonic()
        submit = "\n".join(f"{k} = {v}" for k, v in desc.items()) + "\nqueue vram from sizes.txt\n"
        chroot.write_file(f"{jobdir}/job.sub", submit, owner="migdtest")  # type: ignore[attr-defined]
        pool.condor(["condor_submit", "job.sub"], user="migdtest", cwd=jobdir, timeout=1200)
        submit_s = time.monotonic() - t0
        durations: list[float] = []
        cpu: list[float] = []
        seen_end = 0

        def next_cycle() -> dict[str, object] | None:
            ads = pool.status("-negotiator")
            if not ads:
                return None
            ad = ads[0]
            end = int(ad.get("LastNegotiationCycleEnd0", 0) or 0)
            idle = int(ad.get("LastNegotiationCycleNumIdleJobs0", 0) or 0)
            if end > seen_end and idle >= len(sizes) // 2:
                return ad
            return None

        last: dict[str, object] = {}
        for _ in range(args.cycles):
            last = pool.wait_for(
                next_cycle,
                timeout=args.interval * 4 + 600,
                interval=1.0,
                what="a negotiation cycle that saw the idle jobs",
            )
            seen_end = int(last.get("LastNegotiationCycleEnd0", 0) or 0)  # type: ignore[call-overload]
            durations.append(float(last.get("LastNegotiationCycleDuration0", 0.0)))  # type: ignore[arg-type]
            cpu.append(float(last.get("LastNegotiationCycleCpuTime0", 0.0)))  # type: ignore[arg-type]
            print(label, durations[-1], cpu[-1], flush=True)
        # the schedd builds its autoclusters when the negotiator asks for its jobs
        auto = pool.condor(["condor_q", "-allusers", "-autocluster", "-af", "AutoClusterId"])
        autoclusters = len([ln for ln in auto.stdout.splitlines() if ln.strip()])

        return {
            "label": label,
            "submit_s": submit_s,
            "autoclusters": autoclusters,
            "durations": durations,
            "cpu": cpu,
            "idle": last.get("LastNegotiationCycleNumIdleJobs0"),
            "matches": last.get("LastNegotiationCycleMatches0"),
            "slots": last.get("LastNegotiationCycleCandidateSlots0"),
            "match_s": last.get("LastNegotiationCyclePhase3Duration0"),
        }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--nodes", type=int, default=250)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--interval", type=int, default=20, help="NEGOTIATOR_INTERVAL (s)")
    ap.add_argument("--machine", default="the 2-core development machine")
    ap.add_argument("--out", type=Path, default=RESULTS / "negotiation_scale.md")
    args = ap.parse_args(argv)

    from tests.integration.condor_pool import CondorChroot, PersonalPool

    sizes = [j.memory_mib for j in pool_stream(max(1, args.jobs // 96 + 1), 8)][: args.jobs]
    chroot = CondorChroot()
    chroot.ensure_built()
    rows = []
    with chroot.mounted():
        pslots = {}
        for label, shares, vram in (("migd", 7, True), ("stock", 1, False)):
            chroot.write_file(
                "/usr/local/bin/migd-bench-inventory",
                "#!/bin/sh\ncat <<'EOF'\n" + new_inventory(shares) + "EOF\n",
                mode=0o755,
            )
            with PersonalPool(chroot, "negoscale") as pool:
                pool.start(
                    "MACHINE_RESOURCE_INVENTORY_GPUs = /usr/local/bin/migd-bench-inventory\n"
                    + ("MACHINE_RESOURCE_VRAM = 323584\n" if vram else "")
                    + "NUM_CPUS = 64\nMEMORY = 512000\n"
                )
                pslots[label] = pool.condor(["condor_status", "-long", "slot1@vm"]).stdout
        for label in ("free-form", "rounded", "stock"):
            rows.append(
                run_case(
                    chroot, label, pslots["stock" if label == "stock" else "migd"], sizes, args
                )
            )
    distinct = len(set(sizes))
    lines = [
        "# Negotiation cycle with 20,000 idle GPU jobs",
        "",
        f"Made by `.venv/bin/python bench/negotiation_scale.py --jobs {args.jobs} "
        f"--nodes {args.nodes} --cycles {args.cycles}` (as root, MIGD_CONDOR_ROOT set) on "
        f"{args.machine}; HTCondor 23.9.6 (Debian trixie chroot). {args.jobs:,} idle jobs "
        f"({distinct:,} distinct request_VRAM sizes from `pool_stream`), {args.nodes:,} "
        "advertised partitionable slots of 8 A100-40GB; how: the docstring of "
        "`bench/negotiation_scale.py`.",
        "",
        "| requests | autoclusters | cycle s (median) | cycles s | negotiator CPU s per cycle "
        "| idle jobs seen | candidate slots | submit s |",
        "|---|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        d = r["durations"]
        assert isinstance(d, list)
        lines.append(
            f"| {r['label']} | {r['autoclusters']:,} | {statistics.median(d):.2f} "
            f"| {', '.join(f'{x:.0f}' for x in d)} "
            f"| {', '.join(f'{x:.2f}' for x in r['cpu'])} "  # type: ignore[attr-defined]
            f"| {r['idle']} | {r['slots']} | {r['submit_s']:.0f} |"
        )
    lines.append("")
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
