"""A real condor_collector fed by simulated migd execute nodes: update rate, ad bytes, CPU.

    sudo MIGD_CONDOR_ROOT=/var/tmp/migd-condor-x .venv/bin/python bench/collector_scale.py
    # -> bench/results/collector_scale.md

Three parts:

1. **Update pattern** (pure simulation, an hour per node): each node has 8 A100-40GB and
   gets lease starts and ends at ``--jobs-per-gpu-day`` (12, ``pool_stream``'s rate), sizes
   from the MIG ladder; migd's node ad is rendered at every change. The *old* publisher wrote
   every changed ad with ``update:true`` and repeated it every 60 s; the *new* one is
   :class:`migd.core.ad_updates.AdUpdates` (defaults of ``migctl condor-ad --watch``). Each
   forced update sends every slot ad of the node (the partitionable slot and one dynamic
   slot per running job); the startd's own ``UPDATE_INTERVAL`` (300 s) adds the same for
   both patterns.
2. **Ad bytes per node**: the partitionable slot ad of a real 23.9 startd in the chroot with
   migd's GPU inventory (8 A100 x 7 shares, and 48 shares), old inventory (with
   ``MigdDriverVersion``) and new, as ``condor_status -long`` prints it; dynamic slots are
   that ad with one share's property ad.
3. **Collector CPU**: the chroot's condor_collector is filled with N nodes' slot ads
   (``condor_advertise -multiple UPDATE_STARTD_AD``), then for ``--window`` seconds gets the
   update stream of each pattern (one batch a second); its CPU time comes from
   ``/proc/<pid>/stat``. Where the 2-core machine cannot send a pattern's rate in real time
   the table says the rate reached, and the CPU per 1,000 updates is the figure to scale.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migd.cli.condor_ad import render_inventory  # noqa: E402
from migd.core.ad_updates import AdUpdates  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LADDER = (4864, 9728, 19968, 40448)  # A100-40GB 1g/2g/3g/7g memory (MiB)
GPU_MIB = 40448
UPDATE_INTERVAL_S = 300.0


# --------------------------------------------------------------------------- #
# 1. update pattern
# --------------------------------------------------------------------------- #
@dataclass
class Node:
    free: list[int]
    jobs: list[tuple[int, int]]  # (gpu, mib)
    queued: int = 0

    def ad(self) -> str:
        largest = max(self.free)
        return (
            "MigdHealthy = true\n"
            f"MigdHealthyGpus = {len(self.free)}\n"
            f"MigdLargestPlaceableMB = {largest}\n"
            f"MigdFreeMB = {sum(self.free)}\n"
            f"MigdQueued = {self.queued}\n"
            'MigdModes = "mig"\n'
            "- migd\n"
        )


class OldPublisher:
    """The publisher before this change: every changed ad, and every 60 s, forced."""

    def __init__(self) -> None:
        self.last = ""
        self.at = float("-inf")

    def look(self, ad: str, now: float) -> bool | None:
        if ad != self.last or now - self.at >= 60.0:
            self.last, self.at = ad, now
            return True
        return None


def simulate_node(
    rng: random.Random, hours: float, jobs_per_gpu_day: float, new: bool
) -> tuple[int, int]:
    """(forced updates, slot ads they sent) for one node over ``hours``."""
    node = Node(free=[GPU_MIB] * 8, jobs=[])
    # start the node busy: about 3 jobs a GPU, as in the 25 slot ads per node
    for g in range(8):
        for _ in range(3):
            size = rng.choice(LADDER[:2])
            if node.free[g] >= size:
                node.free[g] -= size
                node.jobs.append((g, size))
    pub_new = AdUpdates(rand=rng.random)
    pub_old = OldPublisher()
    rate = 2 * jobs_per_gpu_day * 8 / 86400.0  # starts + ends per second
    end = hours * 3600.0
    t = rng.uniform(0, 0.25)
    next_event = t + rng.expovariate(rate)
    forced = slot_ads = 0
    while t < end:
        if t >= next_event:
            next_event = t + rng.expovariate(rate)
            if node.jobs and (rng.random() < 0.5 or len(node.jobs) >= 24):
                g, size = node.jobs.pop(rng.randrange(len(node.jobs)))
                node.free[g] += size
            else:
                size = rng.choice(LADDER)
                fits = [g for g in range(8) if node.free[g] >= size]
                if fits:
                    g = min(fits, key=lambda i: node.free[i])
                    node.free[g] -= size
                    node.jobs.append((g, size))
                else:
                    node.queued += 1
            if node.queued and rng.random() < 0.3:
                node.queued -= 1
        ad = node.ad()
        if new:
            p = pub_new.look(ad, t)
            force = p is not None and p.update
        else:
            force = bool(pub_old.look(ad, t))
        if force:
            forced += 1
            slot_ads += 1 + len(node.jobs)
        # the publisher looks every 0.25 s; jump straight to the next moment anything can
        # change (an event) or a timer can fire (a 1 s grid covers the gap and keep-alives)
        t = min(next_event, t + 1.0)
    return forced, slot_ads


def pattern(nodes: int, hours: float, jobs_per_gpu_day: float, seed: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, new in (("old", False), ("new", True)):
        rng = random.Random(seed)
        forced = ads = 0
        for _ in range(nodes):
            f, a = simulate_node(rng, hours, jobs_per_gpu_day, new)
            forced += f
            ads += a
        periodic = nodes * 25 * hours * 3600.0 / UPDATE_INTERVAL_S
        out[f"{name}_forced_per_s"] = forced / (hours * 3600.0)
        out[f"{name}_slot_ads_per_s"] = (ads + periodic) / (hours * 3600.0)
    return out


# --------------------------------------------------------------------------- #
# 2. ad bytes from a real startd
# --------------------------------------------------------------------------- #
def gpus() -> list[dict[str, object]]:
    return [
        {
            "uuid": f"GPU-{i:08x}-a9b5-4c3d-8e7f-0123456789ab",
            "mode": "mig",
            "vram_mib": GPU_MIB,
            "name": "NVIDIA A100-SXM4-40GB",
            "compute_capability": "8.0",
            "cuda_version": "12.4",
            "driver_version": "550.54.15",
        }
        for i in range(8)
    ]


def old_inventory(shares: int) -> str:
    """The inventory before this change: every property ad also had MigdDriverVersion."""
    text = render_inventory(gpus(), shares=shares)
    return re.sub(r"; \]$", '; MigdDriverVersion="550.54.15"; ]', text, flags=re.M)


def new_inventory(shares: int) -> str:
    return render_inventory(gpus(), shares=shares)


def slot_ads(pslot: str, host: str, jobs: int) -> list[str]:
    """The node's slot ads for ``condor_advertise``: the real p-slot ad renamed, and
    ``jobs`` dynamic slots (the p-slot ad with one share's property ad)."""
    lines = [
        ln
        for ln in pslot.splitlines()
        if ln.strip() and not ln.startswith(("Name =", "Machine =", "MyAddress =", "SlotType"))
    ]
    base = [ln for ln in lines if not ln.startswith("GPUs_GPU_")]
    props = [ln for ln in lines if ln.startswith("GPUs_GPU_")]
    addr = f'MyAddress = "<127.0.0.2:9618?alias={host}>"'
    ads = [
        "\n".join(
            [
                *lines,
                f'Name = "slot1@{host}"',
                f'Machine = "{host}"',
                addr,
                'SlotType = "Partitionable"',
            ]
        )
    ]
    for j in range(jobs):
        one = props[j % len(props)] if props else ""
        ads.append(
            "\n".join(
                [
                    *base,
                    one,
                    f'Name = "slot1_{j + 1}@{host}"',
                    f'Machine = "{host}"',
                    addr,
                    'SlotType = "Dynamic"',
                    "DynamicSlot = true",
                ]
            )
        )
    return ads


# --------------------------------------------------------------------------- #
# 3. the collector
# --------------------------------------------------------------------------- #
def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_pid(root: Path, name: str, pids: Callable[[Path], list[int]]) -> int:
    for pid in pids(root):
        try:
            # comm is cut at 15 characters ("condor_collecto")
            if name.startswith(Path(f"/proc/{pid}/comm").read_text().strip()):
                return pid
        except OSError:
            continue
    raise RuntimeError(f"no {name} running in {root}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[100, 1000, 1250])
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--sim-nodes", type=int, default=100, help="nodes simulated for the rates")
    ap.add_argument("--jobs-per-gpu-day", type=float, default=12.0)
    ap.add_argument("--window", type=float, default=10.0, help="seconds of each update stream")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--machine", default="the 2-core development machine")
    ap.add_argument("--out", type=Path, default=RESULTS / "collector_scale.md")
    args = ap.parse_args(argv)

    from tests.integration.condor_pool import CondorChroot, PersonalPool, processes_in

    t_start = time.monotonic()
    # Nodes publish independently, so the pool's rate is a node's rate times the nodes:
    # ``--sim-nodes`` simulated nodes give the per-node mean.
    per_node = pattern(args.sim_nodes, args.hours, args.jobs_per_gpu_day, args.seed)
    rates = {n: {k: v * n / args.sim_nodes for k, v in per_node.items()} for n in args.nodes}

    chroot = CondorChroot()
    chroot.ensure_built()
    sizes: dict[str, dict[str, int]] = {}
    pslots: dict[str, str] = {}
    cpu_rows: list[str] = []
    with chroot.mounted():
        for label, inv in (("old", old_inventory), ("new", new_inventory)):
            for shares in (7, 48):
                chroot.write_file(
                    "/usr/local/bin/migd-bench-inventory",
                    "#!/bin/sh\ncat <<'EOF'\n" + inv(shares) + "EOF\n",
                    mode=0o755,
                )
                with PersonalPool(chroot, "collscale") as pool:
                    pool.start(
                        "MACHINE_RESOURCE_INVENTORY_GPUs = /usr/local/bin/migd-bench-inventory\n"
                        "MACHINE_RESOURCE_VRAM = 323584\n"
                    )
                    pslot = pool.condor(["condor_status", "-long", "slot1@vm"]).stdout
                    if shares == 7:
                        pslots[label] = pslot
                    ads = slot_ads(pslot, "n", 24)
                    sizes.setdefault(label, {})[f"pslot{shares}"] = len(pslot.encode())
                    sizes[label][f"node{shares}"] = sum(len(a.encode()) for a in ads)
                    sizes[label][f"inv{shares}"] = len(inv(shares).encode())
        # the collector: one pool, filled and fed with each pattern in turn
        with PersonalPool(chroot, "collscale") as pool:
            # No negotiator: its queries of every ad would count in the collector's CPU.
            pool.start("DAEMON_LIST = MASTER, COLLECTOR, SCHEDD, STARTD\nCLASSAD_LIFETIME = 3600\n")
            cpid = find_pid(chroot.root, "condor_collector", processes_in)
            for n in args.nodes:
                for label in ("old", "new"):
                    node_ads = [slot_ads(pslots[label], f"node{i:05d}", 24) for i in range(n)]
                    flat = [a for ads in node_ads for a in ads]
                    c0, w0 = proc_cpu_s(cpid), time.monotonic()
                    advertise(chroot, flat)
                    fill_cpu, fill_wall = proc_cpu_s(cpid) - c0, time.monotonic() - w0
                    rate = rates[n][f"{label}_slot_ads_per_s"]
                    rng = random.Random(args.seed)
                    sent, c0, w0 = 0, proc_cpu_s(cpid), time.monotonic()
                    tick = 0
                    while time.monotonic() - w0 < args.window:
                        tick += 1
                        due = int(rate * tick) - sent
                        batch = [rng.choice(flat) for _ in range(max(0, due))]
                        if batch:
                            advertise(chroot, batch)
                            sent += len(batch)
                        spare = w0 + tick - time.monotonic()
                        if spare > 0:
                            time.sleep(spare)
                    wall = time.monotonic() - w0
                    cpu = proc_cpu_s(cpid) - c0
                    cpu_rows.append(
                        f"| {n:,} | {label} | {len(flat):,} | {fill_cpu:.1f} s / {fill_wall:.1f} s "
                        f"| {rate:.1f} | {sent / wall:.1f} | {cpu / wall * 100:.0f} % "
                        f"| {cpu / max(sent, 1) * 1000:.2f} s |"
                    )
                    print(cpu_rows[-1], flush=True)

    lines = [
        "# Collector load of migd's ads",
        "",
        "Made by `.venv/bin/python bench/collector_scale.py "
        f"--nodes {' '.join(map(str, args.nodes))} "
        f"--window {args.window:g}` (as root, MIGD_CONDOR_ROOT set) on {args.machine}, "
        f"HTCondor 23.9.6 from the Debian trixie chroot; {time.monotonic() - t_start:.0f} s. "
        "How it is measured: the docstring of `bench/collector_scale.py`.",
        "",
        f"## Update rate ({args.sim_nodes} nodes x {args.hours:g} h simulated, scaled, "
        f"{args.jobs_per_gpu_day:g} jobs per GPU per day, "
        "8 A100-40GB per node, slot ads include the startd's own update every 300 s)",
        "",
        "| nodes | forced updates/s old | new | slot-ad updates/s old | new |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n in args.nodes:
        r = rates[n]
        lines.append(
            f"| {n:,} | {r['old_forced_per_s']:.1f} | {r['new_forced_per_s']:.2f} "
            f"| {r['old_slot_ads_per_s']:.0f} | {r['new_slot_ads_per_s']:.0f} |"
        )
    lines += [
        "",
        "## Ad bytes per node (8 A100; p-slot ad from the real startd; node = p-slot + 24 "
        "dynamic slots)",
        "",
        "| shares per GPU | inventory old | new | p-slot ad old | new | node old | new |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in (7, 48):
        o, w = sizes["old"], sizes["new"]
        lines.append(
            f"| {s} | {o[f'inv{s}']:,} | {w[f'inv{s}']:,} "
            f"| {o[f'pslot{s}']:,} | {w[f'pslot{s}']:,} "
            f"| {o[f'node{s}']:,} | {w[f'node{s}']:,} |"
        )
    lines += [
        "",
        f"## The collector ({args.window:g} s of each pattern's update stream after filling it)",
        "",
        "| nodes | pattern | slot ads | fill: collector CPU / wall | offered ads/s | sent ads/s "
        "| collector CPU (of one core) | collector CPU per 1,000 updates |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        *cpu_rows,
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


def advertise(chroot: object, ads: list[str]) -> None:
    """Send ``ads`` to the collector in one ``condor_advertise -multiple`` (TCP)."""
    from tests.integration.condor_pool import CondorChroot

    assert isinstance(chroot, CondorChroot)
    chroot.run(
        ["condor_advertise", "-multiple", "-tcp", "UPDATE_STARTD_AD", "-"],
        input="\n\n".join(ads) + "\n\n",
        timeout=600,
    )


if __name__ == "__main__":
    raise SystemExit(main())
