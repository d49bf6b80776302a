"""What a real MPS daemon did, replayed against what migd assumes (issue 13).

``tests/data/mps_gpu_check/20261126T015109Z-h200/`` is ``scripts/mps_gpu_check.sh`` on an
NVIDIA H200 (driver 580.159.04, CUDA 13.0, PyTorch 2.11 clients, MIG off, DEFAULT compute
mode); ``tests/data/gpu_daemon_check/20261126T020227Z-h200/`` is
``scripts/gpu_daemon_check.sh`` there: migd itself on NVML with the GPU in MPS mode.
``.../20261128T022439Z-h100/`` and ``.../20261128T022653Z-h100/`` are the same two scripts
on an NVIDIA H100 80GB HBM3 (same driver, CUDA and PyTorch), run as root with
``SECOND_USER=nobody``, so they also hold a second user's client, a ``-M`` daemon with a
non-root client, the client cap and a ``quit`` under a connected client. Each test states
one fact migd relies on and checks it on the recorded answers, so a change to migd's
parsing or OOM classifier that would misread the real daemon fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from migd.backends.mps.config import MpsManagerConfig
from migd.backends.mps.health import CLIENT_CAP_LOG, CLIENT_CAP_MESSAGE, LOG_PROBLEMS
from migd.backends.nvml import NvmlBackend
from migd.backends.simulated import FakePynvml, SimNode
from migd.core.mps import (
    MPS_CLIENT_CONTEXT_MIB,
    MPS_CLIENT_CONTEXT_MIB_AT_HALF,
    MPS_SERVER_MIB,
    client_context_mib,
    limit_applied,
    parse_limit_mib,
    readable_limit_mib,
)
from migd.core.oom import classify_exit
from migd.daemon.config import MpsSection

DATA = Path(__file__).resolve().parents[1] / "data"
RUN = DATA / "mps_gpu_check" / "20261126T015109Z-h200"
DAEMON_RUN = DATA / "gpu_daemon_check" / "20261126T020227Z-h200"
H100_RUN = DATA / "mps_gpu_check" / "20261128T022439Z-h100"
H100_DAEMON_RUN = DATA / "gpu_daemon_check" / "20261128T022653Z-h100"
RUNS = pytest.mark.parametrize("run", [RUN, H100_RUN], ids=["h200", "h100"])
DAEMON_RUNS = pytest.mark.parametrize(
    "daemon_run", [DAEMON_RUN, H100_DAEMON_RUN], ids=["h200", "h100"]
)


def clients(run: Path = RUN) -> dict[str, dict[str, Any]]:
    lines = (run / "clients.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]  # a crashed client: a blank
    return {row["label"]: row for row in rows if "label" in row}


def replies(command: str, run: Path = RUN) -> list[str]:
    """The front end's output lines for the summary's ``$ printf <command>...`` step."""
    text = (run / "summary.txt").read_text()
    block = text.split(f"$ printf {command}", 1)[1].split("[exit", 1)[0]
    return [line for line in block.splitlines()[1:] if line.strip()]


@RUNS
def test_limits_read_back_as_whole_g_and_migd_accepts_them(run: Path) -> None:
    # set 1536M by UUID, read it back by UUID: the daemon shows whole G, rounded down
    assert replies("set_default_device_pinned_mem_limit\\ GPU-", run) == ["1G"]
    assert parse_limit_mib("1G") == 1024
    # 1G is also what 1024..2047 read back as: it confirms none of them but 1024, so migd
    # sets the daemon's bound in whole G from 1 GiB on, which reads back exactly
    assert not limit_applied("1G", 1536) and limit_applied("1G", 1024)
    assert readable_limit_mib(1536) == 2048
    # and by index: 2048M reads back as 2G (the UUID's own value is kept apart)
    assert replies("set_default_device_pinned_mem_limit\\ 0\\ 2048M", run) == ["2G", "1G"]
    assert limit_applied("2G", 2048)


def test_the_default_set_by_uuid_is_the_one_clients_got_and_the_fake_agrees(
    fake_binary: Path, short_dir: Path
) -> None:
    """Recorded: 1536M by UUID, then 2048M by index 0; the server's limit read 1G and a
    client without its variable had 1536 MiB (964 + 64 > ... its OOM at 1.44 GiB in use).
    The stand-in daemon, driven with the same commands, gives its client 1536 MiB."""
    no_env = clients()["no_env"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in no_env["env"]
    assert "this process has 1.44 GiB memory in use" in no_env["error"]  # 1474 + 64 > 1536
    assert replies("get_client_list\\ ")[1] == "1G"  # the server's limit for device 0
    uuid = "GPU-10bbb7e6-0cd0-8edb-1fb8-c43fb177c923"
    pipe, log = short_dir / "p", short_dir / "l"
    env = {
        **os.environ,
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(log),
        "CUDA_VISIBLE_DEVICES": uuid,
    }
    subprocess.run([str(fake_binary), "-d"], env=env, check=True, timeout=60)

    def ctl(*commands: str) -> str:
        return subprocess.run(
            [str(fake_binary)],
            input="".join(c + "\n" for c in commands),
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout

    try:
        assert ctl(
            f"set_default_device_pinned_mem_limit {uuid} 1536M",
            f"get_default_device_pinned_mem_limit {uuid}",
            "get_default_device_pinned_mem_limit 0",
        ).split() == ["1G"]
        ctl("set_default_device_pinned_mem_limit 0 2048M")
        assert ctl(
            "get_default_device_pinned_mem_limit 0", f"get_default_device_pinned_mem_limit {uuid}"
        ).split() == ["2G", "1G"]
        server = ctl(f"fake_register_client {os.getpid()} {os.getuid()}").strip()
        assert ctl(f"get_device_pinned_mem_limit {server} 0").strip() == "1G"
        assert ctl(f"fake_client_limit {os.getpid()}").strip() == "1536"
        assert (
            "No default pinned memory limit set for the device!"
            in (log / "control.log").read_text()
        )
    finally:
        ctl("quit -t 1")


@RUNS
def test_the_limit_is_per_client_process_and_counts_its_cuda_context(run: Path) -> None:
    got = clients(run)
    over, a, b = got["over_env_limit"], got["same_job_a"], got["same_job_b"]
    # 0=1024M: cudaMemGetInfo says 510 MiB free before any allocation, so ~514 MiB of the
    # limit is the client's own context (PyTorch, CUDA 13; the same on H200 and H100)
    assert over["mem_get_info_mib"][0] == 510 and over["outcome"] == "oom"
    # two clients of one job, each with 0=1024M, each got the whole 1024M for itself:
    # MPS limits a process, not a job (migd accounts memory x mps_clients)
    for client in (a, b):
        assert client["mem_get_info_mib"][0] == 510 and client["allocated_mib"] == 448


@RUNS
def test_a_client_limit_above_the_daemons_default_does_not_raise_it(run: Path) -> None:
    got = clients(run)
    assert got["env_above_default"]["mem_get_info_mib"] == got["no_env"]["mem_get_info_mib"]
    assert got["env_above_default"]["allocated_mib"] == got["no_env"]["allocated_mib"]


@RUNS
def test_migds_classifier_calls_every_recorded_mps_oom_an_oom(run: Path) -> None:
    ooms = [c for c in clients(run).values() if c.get("outcome") == "oom"]
    assert len(ooms) >= 5
    for client in ooms:
        # the clients caught the OOM; a job that does not exits 1 with that text
        verdict = classify_exit(1, None, client["error_type"] + ": " + client["error"], None, 1024)
        assert verdict.kind == "strong", (client["label"], verdict)


def test_the_daemon_carried_the_limit_when_a_client_dropped_its_variable() -> None:
    check = json.loads((RUN / "migd_check.json").read_text())
    by_label = {c["label"]: c for c in check["clients"]}
    with_env = by_label["migd_share"]["client"]
    dropped = by_label["migd_share_env_dropped"]["client"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in dropped["env"]
    # migd's MpsManager set the daemon's default by index; the client saw the same bound
    assert dropped["mem_get_info_mib"] == with_env["mem_get_info_mib"] == [510, 143155]
    assert check["stopped"] is True and check["summary"]["oom_verdicts"] == ["migd_share_env_MB"]


@DAEMON_RUNS
def test_migd_on_a_real_gpu_restarted_the_oom_job_on_a_bigger_share(daemon_run: Path) -> None:
    log = (daemon_run / "daemon_check.log").read_text()
    assert "[migd] the job ran out of GPU memory on an MPS share of 2048 MiB" in log
    assert "restarting on a bigger partition (>= 4096 MiB" in log
    assert "[hw.2 exit 0]" in log and "[hw.1 exit 0]" in log and "[migd exit 0]" in log
    usage = json.loads((daemon_run / "usage-hw1.json").read_text())
    # the job's own process: 2496 MiB allocated by PyTorch plus its context, under 4096
    [proc] = usage["processes"]
    assert usage["scope"] == "job" and 2496 < proc["used_mib"] < usage["limit_mib"]


@DAEMON_RUNS
def test_migd_restarted_under_a_running_job_adopted_its_mps_daemon(daemon_run: Path) -> None:
    log = (daemon_run / "daemon_check.log").read_text()
    assert "[migd exit 0 with hw.3 running]" in log and "[hw.3 exit 0]" in log
    status = json.loads((daemon_run / "status-after-restart.json").read_text())
    assert any("adopted the MPS daemon" in note for note in status["notes"])
    assert status["leases"]["active"] == 1
    leases = json.loads((daemon_run / "leases.json").read_text())["leases"]
    hw3 = [x for x in leases if x["job_id"] == "hw.3"]
    assert [x["state"] for x in hw3] == ["released"], hw3


def test_the_simulator_charges_the_mps_server_and_the_client_context_as_recorded() -> None:
    """Replays probe_during_mps.json: NVML listed the MPS server at 66 MiB and the held
    client (50 % of the threads, 256 MiB allocated by PyTorch) at 530 MiB. The simulated
    GPU, given the same server and client, lists the server at 66 MiB and the client at
    its allocation plus the context migd.core.mps models (271 MiB at 50 %)."""
    probe = json.loads((RUN / "probe_during_mps.json").read_text())
    (gpu,) = probe["gpus"]
    server_rec = next(p for p in gpu["processes"] if not p["mps"])
    client_rec = next(p for p in gpu["processes"] if p["mps"])
    held = clients()["held"]
    assert held["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert (server_rec["used_mib"], held["allocated_mib"]) == (66, 256)
    # The two context figures the model is built from: 1024 - 510 and 1024 - 753.
    assert clients()["over_env_limit"]["mem_get_info_mib"][0] == 1024 - MPS_CLIENT_CONTEXT_MIB
    assert held["mem_get_info_mib"][0] == 1024 - MPS_CLIENT_CONTEXT_MIB_AT_HALF
    assert client_context_mib(100) == 514 and client_context_mib(50) == 271
    assert server_rec["used_mib"] == MPS_SERVER_MIB

    node = SimNode.from_probe(DATA / "gpu" / "h200-141gb-probe.json")
    uuid = node.gpus[0].uuid
    server = subprocess.Popen(["sleep", "300"])  # the server must be a live host process
    try:
        node.procs.track_mps_servers(uuid, [server.pid])
        client_pid = 4_000_002
        node.attach(client_pid, uuid, mps_pinned_limit_mib=1024)
        node.alloc(client_pid, client_context_mib(50))  # what the simulated job does at init
        node.alloc(client_pid, held["allocated_mib"])
        listed = {p.pid: p for p in NvmlBackend(FakePynvml(node)).processes(0)}
        assert listed[server.pid].used_mib == server_rec["used_mib"]
        # NVML counted 3 MiB more than cudaMemGetInfo's context: within 1 %
        assert abs(listed[client_pid].used_mib - client_rec["used_mib"]) <= 5
        # and the rest of the 1024M limit is what the job can still allocate
        assert 1024 - listed[client_pid].used_mib == 1024 - 271 - 256
    finally:
        server.kill()
        server.wait()


# -- what only the H100 run recorded (SECOND_USER set, steps 8, 10 and 11) -------------------


def test_the_h100_client_cap_was_48_and_migd_reads_the_refusal_as_the_cap() -> None:
    """Step 10: 50 light clients at once; the server listed 48, and the other two failed
    CUDA init with error 808 while the server logged the cap. migd's default
    ``[mps] max_clients`` is 48; the health check reads the log line as a refusal at the
    cap (no restart), and the wrapper's classifier sends 808 to migd, not as an OOM."""
    summary = (H100_RUN / "summary.txt").read_text()
    assert "[client cap: 48 of 50 clients connected to server" in summary
    refused = [c for c in clients(H100_RUN).values() if c.get("outcome") == "error"]
    refused = [c for c in refused if c["label"].startswith("cap_")]
    assert len(refused) == 2
    for client in refused:
        assert CLIENT_CAP_MESSAGE in client["error"] and "CUDA error 808" in client["error"]
        verdict = classify_exit(1, None, client["error"], None, 1024)
        assert (verdict.kind, verdict.signature) == ("mps_unavailable", "mps_client_cap")
    cap_lines = [
        line
        for line in (H100_RUN / "server.log").read_text().splitlines()
        if CLIENT_CAP_LOG.search(line)
    ]
    assert len(cap_lines) == 2
    for line in cap_lines:
        found = CLIENT_CAP_LOG.search(line)
        assert found is not None and int(found.group(1)) == 48 == MpsSection().max_clients
        # no other problem pattern reads this line (it is not a crash or a refusing device)
        assert [kind for pattern, kind in LOG_PROBLEMS if pattern.search(line)] == ["client_cap"]


def test_a_second_users_client_waited_for_the_first_users_server_to_drain() -> None:
    """Step 7c: while root's client held its server (10 s), nobody's client hung in CUDA
    init; it ran once root's server was done, on a new server of its own: what migd's
    per-user serialisation (``Admission.waiting_for_uid``) spares jobs from."""
    summary = (H100_RUN / "summary.txt").read_text()
    step = summary.split("## 7c.", 1)[1].split("## 7d.", 1)[0]
    waited = int(step.split("[second user's client took ", 1)[1].split(" s]", 1)[0])
    assert waited >= 10  # at least the first user's hold
    first, second = clients(H100_RUN)["first_user"], clients(H100_RUN)["second_user"]
    assert first["outcome"] == second["outcome"] == "allocated"
    servers_before = replies("get_server_list", H100_RUN)
    servers_after = step.split("$ printf get_server_list", 1)[1].split("[exit", 1)[0].split()
    assert servers_after and servers_after[-1] not in servers_before


def test_a_multi_user_daemon_served_a_non_root_client_within_its_pinned_limit() -> None:
    """Step 11: ``-M`` and a client of user nobody with ``0=1024M``: it connected to the
    root server and had the same 510 MiB free as root's clients under that limit."""
    client = clients(H100_RUN)["multi_user_non_root"]
    assert client["outcome"] == "allocated"
    assert client["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=1024M"
    assert client["mem_get_info_mib"][0] == 1024 - MPS_CLIENT_CONTEXT_MIB


def test_quit_waited_for_the_connected_client() -> None:
    """Step 8: ``quit`` while a connected client held memory for 10 s returned after it
    had gone (13 s). So a plain ``quit`` of a device with a stray client blocks, which is
    why migd bounds it (``quit_timeout_s``) and then kills the daemon."""
    summary = (H100_RUN / "summary.txt").read_text()
    step = summary.split("## 8.", 1)[1].split("## 9.", 1)[0]
    took = int(step.split("[quit returned after ", 1)[1].split(" s;", 1)[0])
    assert 10 <= took < MpsManagerConfig().quit_timeout_s
    assert "client still running: no" in step
    assert clients(H100_RUN)["live_at_quit"]["outcome"] == "allocated"
