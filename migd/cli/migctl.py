"""``migctl``: the admin's window into migd.

Exit codes: 0 success, 1 the daemon refused or the operation failed, 2 usage
error, 3 the daemon is not running (the message says how to start it).
Errors are one line on stderr (``hint:`` on the next); ``-v`` adds the details.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from migd import __version__
from migd.client import DEFAULT_SOCKET, MigdClient
from migd.core.units import format_mib
from migd.errors import DaemonUnavailable, MigdError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def _gib(mib: int | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f}"


def slice_bar(gpu: dict[str, Any], cell: int = 9) -> str:
    """One line per GPU: each placement unit is ``cell`` characters wide.

    ``#`` busy, ``-`` idle, ``.`` free; the label says profile and job.
    """
    units = int(gpu.get("units") or 0)
    if units <= 0:
        return ""
    covered: dict[int, dict[str, Any]] = {}
    for inst in gpu.get("instances", []):
        for u in range(inst["start"], inst["start"] + inst["size"]):
            covered[u] = inst
    out = []
    u = 0
    while u < units:
        inst = covered.get(u)
        if inst is None:
            out.append("[" + "free".center(cell - 2, ".") + "]")
            u += 1
            continue
        width = inst["size"] * cell - 2
        fill = "#" if inst["busy"] else "-"
        label = inst["profile"]
        if inst.get("job_id"):
            label += f" {inst['job_id']}"
        elif inst["status"] != "ready":
            label += f" {inst['status']}"
        elif inst.get("origin") == "unexplained":
            label += " ?"
        else:
            label += " idle"
        out.append("[" + label[:width].center(width, fill) + "]")
        u = inst["start"] + inst["size"]
    return "".join(out)


def render_status(status: dict[str, Any]) -> str:
    d = status["daemon"]
    pol = d["policy"]
    lines = [
        f"migd {d['version']} on {status['node']} (pid {d['pid']}, up {int(d['uptime_s'])}s, "
        f"{d['backend']} backend) placement={pol['placement']}/{pol['gpu_choice']} "
        f"queue={pol['queue']} idle={pol['idle_policy']}",
    ]
    latency = d.get("latency_ms") or {}
    served = [
        f"{op} {v['p50']:.1f}/{v['p99']:.1f}"
        for op, v in sorted(latency.items())
        if op.startswith("lease") or op == "release"
    ]
    if served:
        lines.append("service time p50/p99 ms (last 2048 each): " + ", ".join(served))
    lines.extend(_render_startd(status.get("startd")))
    for gpu in status["gpus"]:
        # Each condition gets its own line below (older daemons send only the summary).
        health = "healthy" if gpu["healthy"] else "UNHEALTHY"
        if not gpu["healthy"] and not gpu.get("conditions"):
            health += f": {gpu['health']}"
        if gpu["draining"]:
            health += ", draining"
        head = (
            f"GPU {gpu['index']}  {gpu['model']}  {gpu['mode'].upper()}  {health}  "
            f"memory {_gib(gpu['memory_used_mib'])}/{_gib(gpu['memory_total_mib'])} GiB"
        )
        if gpu.get("reachability") is not None:
            head += f"  reachability {gpu['reachability']}/{gpu['reachability_max']}"
        lines.append(head)
        for condition in gpu.get("conditions") or []:
            lines.append(f"  [{condition['source']}] {condition['reason']}")
        lines.extend(f"  WARNING: {warning}" for warning in gpu.get("warnings", []))
        bar = slice_bar(gpu)
        if bar:
            lines.append("  " + bar)
        for inst in gpu.get("instances", []):
            who = (
                f"job {inst['job_id']}"
                if inst.get("job_id")
                else ("busy" if inst["busy"] else f"idle {inst['idle_s'] or 0:.0f}s")
            )
            used = inst.get("memory_used_mib")
            mem = f"{_gib(used)}/{_gib(inst['memory_mib'])} GiB"
            extra = f"  ({inst['note']})" if inst.get("note") else ""
            if inst.get("mps"):
                who = f"MPS, {len(inst['mps']['shares'])} job(s)"
            lines.append(
                f"    {inst['profile']}@{inst['start']:<2} {inst['status']:<10} {who:<16} "
                f"{mem:<14} {inst.get('uuid') or '-'}  [{inst['origin']}]{extra}"
            )
            if inst.get("mps"):
                lines.extend("    " + line for line in _render_mps(inst["mps"]))
        if gpu.get("creatable") is not None and gpu["mode"] == "mig":
            can = "  ".join(
                f"{name}@{','.join(map(str, starts))}" for name, starts in gpu["creatable"].items()
            )
            lines.append(f"  can still create: {can or 'nothing (full)'}")
        largest = gpu.get("largest_placeable")
        lines.append(
            "  largest placeable now: "
            + (f"{largest['profile']} ({format_mib(largest['memory_mib'])})" if largest else "none")
        )
        mps = gpu.get("mps")
        if mps:
            lines.extend(_render_mps(mps))
    queue = status.get("queue", [])
    waiting = (status.get("queue_summary") or {}).get("length", len(queue))
    lines.append(
        f"Queue: {waiting} waiting" + (f" (first {len(queue)})" if waiting > len(queue) else "")
    )
    for item in queue:
        lines.append(
            f"  {item['position']}. job {item['job_id']}  {format_mib(item['memory_mib'])}  "
            f"mode {item['mode']}  waiting {item['waiting_s']:.0f}s"
        )
    counts = status.get("leases", {})
    lines.append(
        "Leases: " + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("active", "preparing", "queued"))
    )
    for note in status.get("notes", [])[-10:]:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _render_startd(startd: dict[str, Any] | None) -> list[str]:
    """The startd check (an older daemon sends none): loud when it bypasses migd."""
    if not startd:
        return []
    problems = startd.get("problems") or []
    if not problems:
        if startd.get("skipped"):
            return [f"startd configuration: not checked ({startd['skipped']})"]
        return [f"startd configuration: runs migd's settings ({startd.get('slot_layout')})"]
    lines = [f"WARNING: the startd's configuration bypasses migd ({len(problems)} knob(s)):"]
    for p in problems:
        value = "undefined" if p["value"] is None else repr(p["value"])
        lines += [f"  {p['knob']} = {value}: {p['problem']}", f"    fix: {p['fix']}"]
    return lines


def _render_mps(mps: dict[str, Any]) -> list[str]:
    """An MPS device (a whole GPU or a MIG instance hosting MPS): shares and daemon."""
    lines = [
        f"  MPS: {len(mps['shares'])} job(s), {mps.get('clients', len(mps['shares']))} of "
        f"{mps['max_clients']} clients, pinned {format_mib(mps['pinned_mib'])} of "
        f"{format_mib(mps['capacity_mib'])}"
        + (", multi-user" if mps["multi_user"] else f", uid {mps['uid']}")
    ]
    for share in mps["shares"]:
        pinned = format_mib(share["pinned_mib"])
        extra = f" x {share['clients']} clients" if share.get("clients", 1) > 1 else ""
        if share.get("thread_percentage"):
            extra += f", {share['thread_percentage']} % of the SMs"
        lines.append(f"    job {share['job_id']}: {pinned}{extra} (uid {share['uid']})")
        if share.get("warning"):
            lines.append(f"      WARNING: {share['warning']}")
    for daemon in mps.get("daemons", []):
        age = daemon.get("age_s")
        seen = "not read yet" if age is None else f"read {age:.0f}s ago"
        state = "healthy" if daemon.get("healthy") else f"UNHEALTHY: {daemon.get('last_error')}"
        lines.append(
            f"    daemon pid {daemon['pid']} ({state}; {seen}): servers "
            f"{','.join(map(str, daemon.get('servers', []))) or '-'}, clients "
            f"{len(daemon.get('clients', []))}, log {daemon.get('log_dir')}"
        )
    return lines


def render_leases(leases: list[dict[str, Any]]) -> str:
    if not leases:
        return "no leases"
    rows = [("LEASE", "JOB", "STATE", "GPU", "PARTITION", "LIMIT", "UID", "REASON")]
    for lease in leases:
        part = (
            f"{lease['profile']}@{lease['start']}"
            if lease.get("profile")
            else (lease.get("mode") or "-")
        )
        rows.append(
            (
                lease["lease_id"],
                lease["job_id"],
                lease["state"],
                "-" if lease["gpu"] is None else str(lease["gpu"]),
                part,
                format_mib(lease["memory_limit_mib"]) if lease.get("memory_limit_mib") else "-",
                str(lease["owner_uid"]),
                lease.get("reason", "")
                + (f" WARNING: {lease['warning']}" if lease.get("warning") else ""),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def render_history(rows: list[dict[str, Any]]) -> str:
    out = []
    for row in rows:
        t = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["t"]))
        data = row["data"]
        reason = data.get("reason") or (data.get("decision") or {}).get("reason") or ""
        extra = ", ".join(f"{k}={v}" for k, v in data.items() if k not in ("decision", "reason"))
        out.append(
            f"{t}  {row['event']:<16} job={row['job_id'] or '-'} lease={row['lease_id'] or '-'}"
            + (f"  {reason}" if reason else "")
            + (f"  [{extra}]" if extra else "")
        )
    return "\n".join(out) or "no history"


def render_explain(result: dict[str, Any]) -> str:
    lines = [f"job {result['job_id']}: {len(result['leases'])} lease(s)"]
    for lease in result["leases"]:
        got = lease.get("profile") or lease.get("mode") or "-"
        asked = format_mib(lease["requested_mib"])
        lines.append(
            f"- lease {lease['lease_id']}: {lease['state']}, asked {asked}"
            f" (mode {lease['requested_mode']}), got {got} on GPU {lease.get('gpu')}"
        )
        decision = lease.get("decision") or {}
        if decision.get("reason"):
            lines.append(f"    why: {decision['reason']}")
        for alt in decision.get("alternatives", []):
            lines.append(
                f"    alternative start {alt['start']}: reachability {alt['reachability']}"
                + (f", destroys {', '.join(alt['destroys'])}" if alt.get("destroys") else "")
                + (f", {alt['cost_s']}s" if alt.get("cost_s") else "")
            )
        for other in decision.get("other_gpus", []):
            what = other.get("action") or other.get("why")
            lines.append(f"    GPU {other.get('gpu')}: {what}")
        if lease.get("warning"):
            lines.append(f"    WARNING: {lease['warning']}")
        if lease.get("reason"):
            lines.append(f"    ended: {lease['reason']}")
    lines.append("history:")
    lines.append(render_history(result["history"]))
    return "\n".join(lines)


# -- commands -----------------------------------------------------------------------------------


def cmd_status(client: MigdClient, args: argparse.Namespace) -> int:
    status = client.status()
    if args.json:
        _print_json(status)
    else:
        print(render_status(status))
    return EXIT_OK


def cmd_leases(client: MigdClient, args: argparse.Namespace) -> int:
    result = client.call("leases", all=args.all or None)
    if args.json:
        _print_json(result)
    else:
        print(render_leases(result["leases"]))
    return EXIT_OK


def cmd_explain(client: MigdClient, args: argparse.Namespace) -> int:
    result = client.call("explain", job_id=args.job)
    if args.json:
        _print_json(result)
    else:
        print(render_explain(result))
    return EXIT_OK if result["leases"] else EXIT_FAILED


def cmd_history(client: MigdClient, args: argparse.Namespace) -> int:
    result = client.call("history", job_id=args.job, limit=args.limit)
    if args.json:
        _print_json(result)
    else:
        print(render_history(list(reversed(result["history"]))))
    return EXIT_OK


def cmd_gpu_op(client: MigdClient, args: argparse.Namespace) -> int:
    result = client.call(args.command, gpu=args.gpu)
    if args.json:
        _print_json(result)
    elif args.command == "reset":
        print(
            f"GPU {result['gpu']}: destroying {', '.join(result['destroying']) or 'nothing'}; "
            f"kept busy: {', '.join(result['kept_busy']) or 'none'}"
        )
    else:
        print(f"GPU {result['gpu']}: {'draining' if result['draining'] else 'accepting work'}")
    return EXIT_OK


def cmd_release(client: MigdClient, args: argparse.Namespace) -> int:
    result = client.release(args.lease, reason=args.reason or "released with migctl")
    print(f"lease {args.lease}: {result['state']}")
    return EXIT_OK


def cmd_reload(client: MigdClient, args: argparse.Namespace) -> int:
    # Only sent when asked, so a reload also works against a daemon older than the flag.
    result = client.call("reload", **({"allow_removals": True} if args.allow_removals else {}))
    if args.json:
        _print_json(result)
    elif result.get("reloaded"):
        print("configuration reloaded")
        for key in result.get("needs_restart", []):
            print(f"note: {key} changed; it takes effect after `systemctl restart migd`")
    else:
        err = result.get("error") or {}
        print(
            f"reload failed, old configuration kept: {err.get('message', result)}", file=sys.stderr
        )
        if err.get("hint"):
            print(f"hint: {err['hint']}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_condor_ad(client: MigdClient, args: argparse.Namespace) -> int:
    from migd.cli.condor_ad import render_condor_ad, render_unavailable, watch

    if args.watch:
        import random

        from migd.core.ad_updates import AdUpdates

        try:
            updates = AdUpdates(
                rand=random.random, min_gap_s=args.min_gap, keepalive_s=args.keepalive
            )
        except ValueError as exc:
            print(f"migctl condor-ad: {exc}", file=sys.stderr)
            return EXIT_USAGE
        try:
            watch(
                client.status,
                sys.stdout,
                sleep=time.sleep,
                clock=time.monotonic,
                per_gpu=args.per_gpu,
                interval_s=args.interval,
                updates=updates,
            )
        except BrokenPipeError:  # the startd stopped reading: it restarts us if it wants
            return EXIT_OK
        return EXIT_OK
    try:
        status = client.status()
    except DaemonUnavailable as exc:
        sys.stdout.write(render_unavailable(exc.message))
        return EXIT_OK
    sys.stdout.write(render_condor_ad(status, per_gpu=args.per_gpu))
    return EXIT_OK


def cmd_inventory(client: MigdClient, args: argparse.Namespace) -> int:
    from migd.cli.condor_ad import gpus_for_inventory, render_inventory, render_vram_inventory

    try:
        status = client.status()
    except DaemonUnavailable as exc:
        print(f"migctl: {exc.message}; reading NVML directly", file=sys.stderr)
        status = None
    if args.command == "condor-slots":
        from migd.cli.condor_ad import render_condor_slots

        # The startd's config includes this command's output: if it failed, no HTCondor
        # tool on the node could read its config. Without GPUs: one slot for the node.
        try:
            slot_gpus = gpus_for_inventory(status)
        except Exception as exc:
            print(f"migctl: no GPUs for the slot layout ({exc}); one slot", file=sys.stderr)
            slot_gpus = []
        sys.stdout.write(render_condor_slots(slot_gpus, shares=args.shares))
        return EXIT_OK
    gpus = gpus_for_inventory(status)
    if args.command == "vram-inventory":
        sys.stdout.write(render_vram_inventory(gpus))
    elif args.command == "max-vram":
        from migd.cli.condor_ad import max_vram

        print(f"MIGD_MAX_VRAM = {max_vram(gpus)}")
    else:
        sys.stdout.write(render_inventory(gpus, shares=args.shares))
    return EXIT_OK


def cmd_states(args: argparse.Namespace) -> int:
    from migd.cli.states import run_states

    return run_states(args)


def cmd_simulate(argv: Sequence[str]) -> int:
    """Hand the arguments after ``simulate`` to the simulator's own parser.

    The simulator is imported (and its parser built) only here: it is most of migd's
    code, and ``migctl status`` or a STARTD_CRON ``condor-ad`` should not pay for it.
    """
    import importlib

    sim_cli = importlib.import_module("migd.policysim.cli")
    return int(sim_cli.main(list(argv), prog="migctl simulate"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="migctl", description="Inspect and steer migd.")
    parser.add_argument("--socket", type=Path, default=None, help=f"default {DEFAULT_SOCKET}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show error details")
    parser.add_argument("--version", action="version", version=f"migctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if json_flag:
            p.add_argument("--json", action="store_true", help="machine-readable output")
        return p

    add("status", "GPUs, instances, MPS, queue and what can still be created")
    p = add("leases", "current leases (--all: recent ended ones too)")
    p.add_argument("--all", action="store_true")
    p = add("explain", "why a job got (or did not get) its partition")
    p.add_argument("job", help="HTCondor job id, e.g. 123.0")
    p = add("history", "recent decisions and events")
    p.add_argument("--job", default=None)
    p.add_argument("--limit", type=int, default=50)
    for name, text in (
        ("drain", "stop placing new work on a GPU (running jobs continue)"),
        ("resume", "place work on a drained GPU again"),
        ("reset", "destroy every idle MIG instance of a GPU (busy ones are kept)"),
    ):
        p = add(name, text)
        p.add_argument("gpu", help="GPU index or UUID")
    p = add("release", "release a lease (its owner or an admin)", json_flag=False)
    p.add_argument("lease")
    p.add_argument("--reason", default="")
    p = add("reload", "re-read the configuration (same as SIGHUP)")
    p.add_argument(
        "--allow-removals",
        action="store_true",
        help="apply it even if it drops access settings or every [[gpu]] table "
        "(a reload refuses that by default: docs/configuration.md, Reload)",
    )
    p = add("condor-ad", "ClassAd attributes for a STARTD_CRON job", json_flag=False)
    p.add_argument(
        "--per-gpu", action="store_true", help="also one ad per GPU (one p-slot per GPU layouts)"
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="keep running, print a new ad when it changes (STARTD_CRON mode WaitForExit)",
    )
    p.add_argument(
        "--interval", type=float, default=0.5, help="--watch: seconds between looks at migd"
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=600.0,
        help="--watch: a collector update after this many seconds without one (less up to 20%%)",
    )
    p.add_argument(
        "--min-gap",
        type=float,
        default=1.0,
        help="--watch: seconds between collector updates for changes (a burst becomes one)",
    )
    p = add(
        "gpu-inventory",
        "MACHINE_RESOURCE_INVENTORY_GPUs output: physical GPUs as distinct share IDs",
        json_flag=False,
    )
    p.add_argument(
        "--shares", type=int, default=7, help="IDs per GPU = jobs that may share it (default 7)"
    )
    p = add(
        "condor-slots",
        "the startd's slot layout: one partitionable slot per GPU with its shares and VRAM "
        "(include command in 10-migd-execute.config, MIGD_SLOT_PER_GPU)",
        json_flag=False,
    )
    p.add_argument(
        "--shares", type=int, default=7, help="IDs per GPU, as for gpu-inventory (default 7)"
    )
    add(
        "vram-inventory",
        "MACHINE_RESOURCE_INVENTORY_VRAM output: the node's GPU memory pool",
        json_flag=False,
    )
    add(
        "max-vram",
        "the largest partition this node gives one job (MiB): set the access point's "
        "MIGD_MAX_VRAM to the largest over the pool's nodes",
        json_flag=False,
    )
    p = add(
        "pool-defaults",
        "on an access point: MIGD_MAX_VRAM and the served modes from the pool's migd nodes "
        "(a SCHEDD_CRON job, condor_config/20-migd-access-point.config)",
        json_flag=False,
    )
    p.add_argument("--write", type=Path, default=None, help="config file to keep up to date")
    p.add_argument(
        "--reconfig", action="store_true", help="condor_reconfig the schedd when it changed"
    )
    p = add("states", "dump a model's partition state table (offline)")
    p.add_argument("--model", help="e.g. A100-40GB (see --list-models)")
    p.add_argument(
        "--profiles", default="standard", help="standard | classic | media | all | a,b,c"
    )
    p.add_argument("--list-models", action="store_true")
    p.add_argument("--full-only", action="store_true", help="only full (maximal) states")
    # Everything after `simulate` (its --help included) belongs to the simulator's parser,
    # so this one declares no options of its own: main() passes them on unparsed.
    sub.add_parser(
        "simulate", help="run the simulator (see `migctl simulate --help`)", add_help=False
    )
    return parser


COMMANDS: dict[str, Callable[[MigdClient, argparse.Namespace], int]] = {
    "status": cmd_status,
    "leases": cmd_leases,
    "explain": cmd_explain,
    "history": cmd_history,
    "drain": cmd_gpu_op,
    "resume": cmd_gpu_op,
    "reset": cmd_gpu_op,
    "release": cmd_release,
    "reload": cmd_reload,
    "condor-ad": cmd_condor_ad,
    "gpu-inventory": cmd_inventory,
    "vram-inventory": cmd_inventory,
    "max-vram": cmd_inventory,
    "condor-slots": cmd_inventory,
}


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    # `migctl status | head` should end quietly, not with a BrokenPipeError traceback
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        # Only `simulate` takes arguments this parser does not know (the simulator's, in
        # their order); for any other command they are an error, as parse_args makes them.
        args, rest = parser.parse_known_args(argv)
        if args.command != "simulate" and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    if args.command == "simulate":
        return cmd_simulate(rest)
    try:
        if args.command == "states":
            return cmd_states(args)
        if args.command == "pool-defaults":  # on an access point: no migd there
            from migd.cli.pool_defaults import main as pool_defaults

            return pool_defaults(args.write, args.reconfig)
        client = MigdClient(args.socket)
        return COMMANDS[args.command](client, args)
    except DaemonUnavailable as exc:
        print(f"migctl: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return EXIT_DOWN
    except MigdError as exc:
        print(f"migctl: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        if args.verbose and exc.details:
            print(json.dumps(exc.details, indent=2, default=str), file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
