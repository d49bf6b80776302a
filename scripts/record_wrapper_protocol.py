"""Record what an older migd's job wrapper says to migd, for the rolling-upgrade test.

    .venv/bin/python scripts/record_wrapper_protocol.py COMMIT OUT.json

Runs ``migd-run`` and ``migd-wrapper`` (with a GPU job ad) from ``git archive COMMIT``
against this tree's daemon on a simulated A100, through a proxy socket that records each
request line and reply. tests/process/test_rolling_upgrade.py replays the requests
against the current daemon. Re-record when the compatibility window moves (docs/api.md,
"Versions across a pool").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _proxy(listen: Path, upstream: Path, log: list[dict[str, Any]]) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(listen))
    server.listen(8)

    def serve(conn: socket.socket, conn_no: int) -> None:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        up.connect(str(upstream))
        down_r, up_r = conn.makefile("rb"), up.makefile("rb")
        for line in down_r:
            up.sendall(line)
            reply = up_r.readline()
            log.append(
                {"connection": conn_no, "request": json.loads(line), "reply": json.loads(reply)}
            )
            conn.sendall(reply)
        up.close()
        conn.close()

    def accept() -> None:
        n = 0
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            n += 1
            threading.Thread(target=serve, args=(conn, n), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def main() -> int:
    commit, out = sys.argv[1], Path(sys.argv[2])
    with tempfile.TemporaryDirectory(prefix="migd-rec-") as tmp:
        root = Path(tmp)
        old = root / "old"
        old.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit, "migd"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        run = root / "run"  # migd refuses a runtime directory any user may write to
        run.mkdir(mode=0o755)
        sock, proxy_sock = run / "migd.sock", root / "proxy.sock"
        (root / "migd.toml").write_text('version = 1\n[api]\nlease_users = ["*"]\n')
        daemon = subprocess.Popen(
            [
                *(sys.executable, "-m", "migd", "--config", str(root / "migd.toml")),
                *("--simulate", "1xA100-40GB", "--state-dir", str(root / "state")),
                *("--runtime-dir", str(run), "--socket", str(sock)),
                *("--set", "backend.sim_time_scale=0", "--set", "htcondor.offline_gpus=false"),
            ],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while not sock.exists():
                if time.monotonic() > deadline or daemon.poll() is not None:
                    raise SystemExit("the daemon did not start")
                time.sleep(0.1)
            log: list[dict[str, Any]] = []
            server = _proxy(proxy_sock, sock, log)
            env = {**os.environ, "PYTHONPATH": str(old), "MIGD_API_SOCKET": str(proxy_sock)}
            env.pop("_CONDOR_JOB_AD", None)
            run_py = "from migd.wrapper.main import run_main as m; import sys; sys.exit(m())"
            subprocess.run(
                [sys.executable, "-c", run_py, "--gpu-memory", "3G", "--", "true"],
                env=env,
                check=True,
            )
            ad = root / ".job.ad"
            ad.write_text(
                'ClusterId = 7\nProcId = 0\nOwner = "someone"\nRequestGPUs = 1\n'
                "RequestVRAM = 4096\n"
            )
            wrap = "from migd.wrapper.main import wrapper_main as m; import sys; sys.exit(m())"
            subprocess.run(
                [sys.executable, "-c", wrap, "true"],
                env={**env, "_CONDOR_JOB_AD": str(ad), "_CONDOR_SCRATCH_DIR": str(root)},
                check=True,
            )
            server.close()
        finally:
            daemon.terminate()
            daemon.wait(30)
    record = {
        "commit": commit,
        "what": "requests of migd-run --gpu-memory 3G -- true, then migd-wrapper true with a "
        "GPU job ad (RequestGPUs = 1, RequestVRAM = 4096), as the wrapper of this commit "
        "sends them; the replies of the daemon that recorded them",
        "exchanges": log,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(log)} exchanges recorded in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
