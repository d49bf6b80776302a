"""A fake CUDA job for the simulated backend: ``python -m migd.backends.simulated.cuda_job``.

It finds its device the way a CUDA program does (``CUDA_VISIBLE_DEVICES``) and,
with ``CUDA_MPS_PIPE_DIRECTORY`` set, connects to the MPS control daemon there as
CUDA init would (the stand-in ``nvidia-cuda-mps-control`` of
:mod:`migd.backends.simulated.mps_control`): the server tells it its pinned-memory
limit, its own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` lowered by the server's, and
without a daemon it runs without MPS and without a limit, as CUDA does. It then
attaches to the simulated GPU inside migd, allocates memory step by step and,
when an allocation does not fit, prints PyTorch's out-of-memory message and
exits 1, exactly what the wrapper sees from a real job. With
``MIGD_MEMSTATS_FILE`` set it writes allocator statistics per step, as a PyTorch
job instrumented for the forecast would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from migd.client import MigdClient
from migd.core.units import parse_mib
from migd.errors import MigdError


def _connect_mps(pid: int) -> tuple[bool, int | None, str]:
    """CUDA init under MPS: (connected, enforced limit MiB, error) for this process.

    Not connected (no daemon on the pipe directory): the program runs without MPS.
    """
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    if not pipe:
        return False, None, ""
    from migd.backends.simulated.mps_control import (
        CLIENT_CAP_MESSAGE,
        ClientRefused,
        connect_client,
    )

    try:
        got = connect_client(
            pipe, pid, os.getuid(), os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "")
        )
    except ClientRefused as exc:
        if CLIENT_CAP_MESSAGE in str(exc):  # error 808, as a real client past the cap
            return True, None, f"CUDA error: {CLIENT_CAP_MESSAGE}"
        return True, None, f"CUDA error: all CUDA-capable devices are busy or unavailable ({exc})"
    if got is None:
        return False, None, ""
    return True, got[1], ""


def context_mib() -> int:
    """The CUDA context this MPS client holds inside its pinned limit: as recorded on an
    H200 (:func:`migd.core.mps.client_context_mib`, by its thread percentage), or
    ``MIGD_SIM_CUDA_CONTEXT_MIB`` (a test's choice, 0 for none)."""
    from migd.core.mps import client_context_mib

    override = os.environ.get("MIGD_SIM_CUDA_CONTEXT_MIB")
    if override is not None:
        return max(0, int(override))
    pct = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
    try:
        return client_context_mib(round(float(pct)) if pct else None)
    except ValueError:
        return client_context_mib(None)


def _charge_context(client: MigdClient, pid: int) -> bool:
    """CUDA init under MPS: the context is allocated first, inside the pinned limit. A
    limit below it fails at init, as a real client with ``0=512MB`` did (an
    AcceleratorError "CUDA error: out of memory" from its first CUDA call)."""
    mib = context_mib()
    if not mib:
        return True
    reply = client.call("sim_alloc", pid=pid, mib=mib)
    if reply.get("oom"):
        print(
            "torch.AcceleratorError: CUDA error: out of memory (the CUDA context, "
            f"{mib} MiB, does not fit in the MPS pinned limit)",
            file=sys.stderr,
            flush=True,
        )
        return False
    if reply.get("cuda_error"):
        print(f"RuntimeError: {reply['cuda_error']}", file=sys.stderr, flush=True)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simjob", description=__doc__)
    parser.add_argument("--start", default="512M", help="memory allocated at start")
    parser.add_argument("--grow", default="0", help="memory added per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-s", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--exit", type=int, default=0, help="exit code when done")
    parser.add_argument(
        "--start-delay",
        type=float,
        default=0.0,
        help="seconds of start-up after the first allocation",
    )
    parser.add_argument("--print-env", action="store_true")
    parser.add_argument("--socket", default=None)
    args = parser.parse_args(argv)
    if args.print_env:
        for key in sorted(os.environ):
            if key.startswith(("CUDA_", "NVIDIA_", "MIGD_", "APPTAINERENV_CUDA")):
                print(f"{key}={os.environ[key]}", flush=True)
    device = (os.environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    if not device or device in ("10000", "-1"):
        print("RuntimeError: CUDA error: no CUDA-capable device is detected", file=sys.stderr)
        return 1
    client = MigdClient(args.socket or os.environ.get("MIGD_API_SOCKET"), timeout_s=10)
    pid = os.getpid()
    mps, limit_mib, mps_error = _connect_mps(pid)
    if mps_error:
        print(f"RuntimeError: {mps_error}", file=sys.stderr, flush=True)
        return 1
    try:
        reply = client.call("sim_attach", pid=pid, device_uuid=device, mps_limit_mib=limit_mib)
    except MigdError as exc:
        print(f"RuntimeError: CUDA error: initialization error ({exc.message})", file=sys.stderr)
        return 1
    if reply.get("cuda_error"):
        print(f"RuntimeError: {reply['cuda_error']}", file=sys.stderr)
        return 1
    if mps and not _charge_context(client, pid):
        return 1
    memstats = os.environ.get("MIGD_MEMSTATS_FILE")
    total = 0
    # migd hears the job's own peak (a job instrumented to say what it used, as the
    # wrapper's MIGD_LEASE_ID allows): samples once a second miss a short burst.
    lease_id = os.environ.get("MIGD_LEASE_ID")
    try:
        for step in range(args.steps + 1):
            want = parse_mib(args.start) if step == 0 else parse_mib(args.grow)
            if want:
                reply = client.call("sim_alloc", pid=pid, mib=want)
                if reply.get("oom"):
                    limit = reply.get("limit_mib") or 0
                    used = reply.get("used_mib") or total
                    print(
                        "Traceback (most recent call last):\n"
                        '  File "train.py", line 42, in <module>\n'
                        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
                        f"{want:.2f} MiB. GPU 0 has a total capacity of {limit / 1024:.2f} GiB "
                        f"of which {max(0, limit - used):.2f} MiB is free. Of the allocated "
                        # PyTorch counts its own allocations (not the driver's reserve)
                        f"memory {total:.2f} MiB is allocated by PyTorch.",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                if reply.get("cuda_error"):
                    print(f"RuntimeError: {reply['cuda_error']}", file=sys.stderr, flush=True)
                    return 1
                total += want
            if step == 0 and args.start_delay > 0:
                time.sleep(args.start_delay)  # loading a model: memory held, no iterations yet
            if memstats:
                row = {"step": step, "allocated_mib": total, "used_mib": total}
                with Path(memstats).open("a") as f:
                    f.write(json.dumps(row) + "\n")
            print(f"step {step}: {total} MiB on {device}", flush=True)
            time.sleep(args.step_s)
    finally:
        if lease_id and total:
            with contextlib.suppress(MigdError):
                client.call(
                    "report",
                    lease_id=lease_id,
                    event="note",
                    data={"peak_used_mib": total, "source": "simjob"},
                )
        with contextlib.suppress(MigdError):
            client.call("sim_detach", pid=pid)
        if mps:
            from migd.backends.simulated.mps_control import disconnect_client

            disconnect_client(os.environ["CUDA_MPS_PIPE_DIRECTORY"], pid)
    print(f"simjob: done, peak {total} MiB on {device}", flush=True)
    return int(args.exit)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
