#!/usr/bin/env python3
"""migd's own MPS code against a real ``nvidia-cuda-mps-control`` (part of mps_gpu_check.sh).

Starts the device's daemon the way the migd daemon does (:class:`MpsManager`, private
runtime directory, the share's pinned limit as the daemon's limit), runs CUDA clients
with the environment migd hands a job, and classifies each client's exit with the
wrapper's OOM classifier (:func:`migd.core.oom.classify_exit`). Then it stops the
daemon. Everything it saw goes to one JSON file (``--out``), shaped for tests/data/.

    python3 scripts/mps_migd_check.py --binary nvidia-cuda-mps-control \\
        --device GPU-... --limit-mib 1024 --out result.json -- python3 client.py

The client command gets two more arguments, a label and the MiB to allocate, and the
job environment. It should allocate in steps and fail the way a CUDA program does
(mps_gpu_check.sh's client prints PyTorch's or the driver's error on stderr).

Runs with the fake control daemon too (tests/mps/test_gpu_check_script.py), so the
script itself is tested without a GPU. It changes no GPU setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing migd
    sys.path.insert(0, str(REPO))

from migd.backends.mps import MpsManager, MpsManagerConfig  # noqa: E402
from migd.core.mps import MpsShare, parse_pinned_limit_env  # noqa: E402
from migd.core.oom import classify_exit  # noqa: E402
from migd.errors import MigdError  # noqa: E402


def run_client(
    command: list[str], label: str, target_mib: int, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    began = time.monotonic()
    try:
        proc = subprocess.run(
            [*command, label, str(target_mib)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        code: int | None = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = None
        stdout = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else ""
        stderr = f"timed out after {timeout_s} s"
    report: dict[str, Any] = {}
    for line in reversed(stdout.splitlines()):
        try:
            report = json.loads(line)
            break
        except ValueError:
            continue
    # The client may catch its OOM and exit 0 with a report: what the wrapper would see
    # is its stderr tail, so the error line it reported counts as stderr too.
    tail = stderr + ("\n" + str(report.get("error")) if report.get("error") else "")
    limit = parse_pinned_limit_env(
        env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", ""), env.get("CUDA_VISIBLE_DEVICES")
    )
    verdict = classify_exit(code, None, tail, report.get("allocated_mib"), limit)
    return {
        "label": label,
        "target_mib": target_mib,
        "exit_code": code,
        "seconds": round(time.monotonic() - began, 2),
        "env": {k: v for k, v in env.items() if k.startswith(("CUDA_", "NVIDIA_"))},
        "client": report,
        "stderr_tail": stderr[-2000:],
        "verdict": verdict.to_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--binary", default="nvidia-cuda-mps-control")
    parser.add_argument("--device", required=True, help="GPU or MIG UUID")
    parser.add_argument("--limit-mib", type=int, default=1024)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--runtime-dir", type=Path, default=None)
    parser.add_argument("--client-timeout-s", type=float, default=300.0)
    parser.add_argument("client", nargs=argparse.REMAINDER, help="-- CLIENT COMMAND")
    args = parser.parse_args(argv)
    command = [c for c in args.client if c != "--"] if args.client else []
    if not command:
        parser.error("give the client command after --")
    runtime = args.runtime_dir or Path(tempfile.mkdtemp(prefix="migd-chk-", dir="/tmp"))
    manager = MpsManager(
        runtime,
        MpsManagerConfig(binary=args.binary, systemd_scope=False, prestart_server=True),
    )
    result: dict[str, Any] = {
        "kind": "migd-mps-check",
        "device": args.device,
        "binary": args.binary,
        "limit_mib": args.limit_mib,
        "uid": os.getuid(),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "clients": [],
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    try:
        result["adoption"] = {"adopted": list(manager.start().adopted)}
        share = MpsShare("mps-check", uid=os.getuid(), gid=os.getgid(), memory_mib=args.limit_mib)
        job_env = manager.ensure_share(args.device, share)
        result["job_env"] = job_env
        (status,) = [s.to_dict() for s in manager.status()]
        result["daemon"] = status
        over = args.limit_mib * 2
        env = {**base, **job_env}
        result["clients"].append(
            run_client(command, "migd_share", over, env, args.client_timeout_s)
        )
        # The same job without the variable: still held by the server's limit.
        dropped = {k: v for k, v in env.items() if k != "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"}
        result["clients"].append(
            run_client(command, "migd_share_env_dropped", over, dropped, args.client_timeout_s)
        )
        # The value syntax NVIDIA's example uses ("0=1G,1=512MB"): MB instead of M.
        mb = {**env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={args.limit_mib // 2}MB"}
        result["clients"].append(
            run_client(command, "migd_share_env_MB", args.limit_mib, mb, args.client_timeout_s)
        )
        result["health_after"] = [e.to_dict() for e in manager.check_health().events]
    except MigdError as exc:
        result["error"] = exc.to_dict()
    finally:
        try:
            manager.shutdown()
            result["stopped"] = not manager.status()
        except MigdError as exc:
            result["stop_error"] = exc.to_dict()
    oom = [c for c in result["clients"] if c["verdict"]["kind"] in ("strong", "weak")]
    result["summary"] = {
        "clients": len(result["clients"]),
        "oom_verdicts": [c["label"] for c in oom],
        "migd_handles_the_oom": bool(result["clients"]) and result["clients"][0] in oom,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result["summary"]))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
