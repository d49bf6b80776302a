#!/usr/bin/env python3
"""Run a command with a MIG device of its own, destroyed afterwards. WRITES.

    scripts/with_mig_instance.py [--gpu 0] [--profile NAME] -- COMMAND...

For a GPU that is **already in MIG mode and empty** (it refuses otherwise, changing
nothing): creates one GPU instance of the smallest profile (or ``--profile``) with its
compute instance, runs COMMAND with ``MIG_UUID`` and ``GPU_UUID`` set to the new MIG
device's UUID, then destroys the instance: when the command ends, on any error, and on
SIGTERM, SIGINT or SIGHUP (held during the create and the destroy, as in
mig_calibrate.py). ``gpu_checks.sh`` uses it to check MPS inside a MIG device and migd
in MIG mode. It never changes MIG mode, compute mode or clocks and never resets a GPU.
Exit status: the command's; 3 refused; 2 error; 128+N after signal N.
``--simulate DESCRIPTION`` runs on a simulated node (the command sees a made-up MIG UUID).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mig_calibrate import (
    Calibration,
    Counter,
    Interrupted,
    Refused,
    stop_signals_raise,
)

from migd.backends.nvml import NvmlBackend
from migd.errors import MigdError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--profile", help="profile name (default: the smallest)")
    parser.add_argument("--simulate", metavar="DESCRIPTION")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("a command is needed after --")
    sleeps = Counter(time.sleep)
    if args.simulate:
        from migd.backends.simulated import FakePynvml, SimNode

        backend = NvmlBackend(FakePynvml(SimNode.from_description(args.simulate)), sleep=sleeps)
    else:
        import pynvml

        backend = NvmlBackend(pynvml, sleep=sleeps)
    cal = Calibration(backend, args.gpu, sleeps)
    try:
        with stop_signals_raise():
            try:
                cal.check_idle()
                geometry = backend.geometry(args.gpu)
                profiles = [p for p in geometry.profiles if p.name == args.profile] or [
                    min(geometry.profiles, key=lambda p: (p.memory_slices, p.compute_slices))
                ]
                profile = profiles[0]
                with cal.cleanup():
                    inst, _s, _r = cal.create(profile.profile_id, cal.starts(profile.profile_id)[0])
                    print(
                        f"with_mig_instance: {profile.name} GI {inst.gi_id} -> {inst.uuid}",
                        flush=True,
                    )
                    env = {**os.environ, "MIG_UUID": inst.uuid or "", "GPU_UUID": inst.uuid or ""}
                    proc = subprocess.Popen(command, env=env)
                    try:
                        return proc.wait()
                    finally:
                        if proc.poll() is None:  # a signal came: stop the command first
                            proc.terminate()
                            try:
                                proc.wait(timeout=60)
                            except subprocess.TimeoutExpired:
                                proc.kill()
                                proc.wait()
            except Refused as err:
                print(f"with_mig_instance: refusing: {err}", file=sys.stderr)
                return 3
            except MigdError as err:
                print(f"with_mig_instance: {err}", file=sys.stderr)
                return 2
    except Interrupted as sig:
        print(f"with_mig_instance: stopped by {sig}; the instance is destroyed", file=sys.stderr)
        return 128 + sig.signum
    finally:
        if cal.made:
            print(f"with_mig_instance: could not destroy GI {cal.made}", file=sys.stderr)
        backend.close()


if __name__ == "__main__":
    raise SystemExit(main())
