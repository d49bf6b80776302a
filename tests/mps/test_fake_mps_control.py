"""The fake nvidia-cuda-mps-control behaves like the real one where migd relies on it."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from migd.backends.simulated.mps_control import (
    ALREADY_RUNNING_MESSAGE,
    CLIENT_CAP_LOG,
    CLIENT_CAP_MESSAGE,
    NO_DAEMON_MESSAGE,
    PID_FILE_NAME,
    fault_path,
)
from tests.waiting import wait_for

from .conftest import kill_fake, pid_alive

REAL_H100 = Path(__file__).resolve().parents[1] / "data" / "mps_gpu_check" / "20261128T022439Z-h100"


def run(
    binary: Path, pipe: Path, log: Path, *args: str, stdin: str = "", **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": os.environ["PATH"],
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(log),
            "CUDA_VISIBLE_DEVICES": "GPU-11111111-2222-3333-4444-555555555555",
            **env,
        },
        check=False,
    )


@pytest.fixture
def dirs(short_dir: Path) -> tuple[Path, Path]:
    return short_dir / "pipe", short_dir / "log"


@pytest.fixture
def start_daemon(fake_binary: Path, dirs: tuple[Path, Path]) -> Iterator[Callable[..., None]]:
    """``start_daemon(*args, **env)`` runs ``-d *args`` (``env`` added to its environment);
    after the test the daemon is stopped with ``quit -t 0``, whatever happened."""
    pipe, log = dirs

    def start(*args: str, **env: str) -> None:
        assert run(fake_binary, pipe, log, "-d", *args, **env).returncode == 0

    yield start
    run(fake_binary, pipe, log, stdin="quit -t 0\n")


def test_client_without_daemon_says_so_and_fails(
    fake_binary: Path, dirs: tuple[Path, Path]
) -> None:
    pipe, log = dirs
    result = run(fake_binary, pipe, log, stdin="get_server_list\n")
    assert result.returncode == 1
    assert result.stdout.strip() == NO_DAEMON_MESSAGE


def test_daemon_writes_pid_file_refuses_second_instance_and_quits(
    fake_binary: Path, dirs: tuple[Path, Path]
) -> None:
    pipe, log = dirs
    assert run(fake_binary, pipe, log, "-d").returncode == 0
    pid = int((pipe / PID_FILE_NAME).read_text())
    assert pid_alive(pid)
    second = run(fake_binary, pipe, log, "-d")
    assert (second.returncode, second.stdout.strip()) == (1, ALREADY_RUNNING_MESSAGE)
    assert "Starting control daemon using socket" in (log / "control.log").read_text()

    quit_ = run(fake_binary, pipe, log, stdin="quit\n")
    assert quit_.returncode == 0
    wait_for(lambda: not pid_alive(pid), what="daemon exit after quit")
    assert not (pipe / PID_FILE_NAME).exists()


def test_replies_follow_the_real_formats(
    fake_binary: Path, dirs: tuple[Path, Path], start_daemon: Callable[..., None]
) -> None:
    pipe, log = dirs
    start_daemon()
    out = run(
        fake_binary,
        pipe,
        log,
        stdin=(
            "get_server_list\n"
            "set_default_active_thread_percentage 25\n"
            "get_default_active_thread_percentage\n"
            "set_default_device_pinned_mem_limit 0 512M\n"
            "get_default_device_pinned_mem_limit 0\n"
            "start_server -uid 1234\n"
            "get_server_list\n"
        ),
    )
    assert out.returncode == 0
    lines = out.stdout.split()
    # empty server list prints nothing; set echoes "25.0"; limits print as <n>M
    assert lines[:3] == ["25.0", "25.0", "512M"]
    (server,) = lines[3:]
    assert pid_alive(int(server))

    # A malformed limit is taken silently, as a real daemon did (H200, driver 580.159.04,
    # tests/data/mps_gpu_check/20261126T015109Z-h200/summary.txt step 3): only a read-back
    # shows that nothing was set.
    bad = run(
        fake_binary,
        pipe,
        log,
        stdin="set_default_device_pinned_mem_limit 0 lots\nget_default_device_pinned_mem_limit 0\n",
    )
    assert bad.returncode == 0 and bad.stdout.split() == ["512M"]


def test_defaults_reach_only_servers_started_later(
    fake_binary: Path,
    dirs: tuple[Path, Path],
    client_procs: Callable[[], int],
    start_daemon: Callable[..., None],
) -> None:
    pipe, log = dirs
    start_daemon()
    run(fake_binary, pipe, log, stdin="set_default_device_pinned_mem_limit 0 1024M\n")
    first = run(
        fake_binary, pipe, log, stdin=f"fake_register_client {client_procs()} 1000\n"
    ).stdout.strip()
    run(fake_binary, pipe, log, stdin="set_default_device_pinned_mem_limit 0 2048M\n")
    status = json.loads(run(fake_binary, pipe, log, stdin="fake_status\n").stdout)
    (server,) = status["servers"]
    assert server["pid"] == int(first)
    assert server["pinned_limits"] == {"0": "1024M"}
    assert status["default_pinned_limits"] == {"0": "2048M"}


def test_per_user_clients_wait_while_another_user_is_served(
    fake_binary: Path,
    dirs: tuple[Path, Path],
    client_procs: Callable[[], int],
    start_daemon: Callable[..., None],
) -> None:
    pipe, log = dirs
    first, second = client_procs(), client_procs()
    start_daemon()
    assert (
        run(fake_binary, pipe, log, stdin=f"fake_register_client {first} 1000\n")
        .stdout.strip()
        .isdigit()
    )
    other = run(fake_binary, pipe, log, stdin=f"fake_register_client {second} 2000\n").stdout
    assert other.startswith("ERROR: pending")
    run(fake_binary, pipe, log, stdin=f"fake_unregister_client {first}\n")
    assert (
        run(fake_binary, pipe, log, stdin=f"fake_register_client {second} 2000\n")
        .stdout.strip()
        .isdigit()
    )


def test_multi_user_daemon_serves_all_users_from_one_root_server(
    fake_binary: Path,
    dirs: tuple[Path, Path],
    client_procs: Callable[[], int],
    start_daemon: Callable[..., None],
) -> None:
    pipe, log = dirs
    start_daemon("-M")
    a = run(
        fake_binary, pipe, log, stdin=f"fake_register_client {client_procs()} 1000\n"
    ).stdout.strip()
    b = run(
        fake_binary, pipe, log, stdin=f"fake_register_client {client_procs()} 2000\n"
    ).stdout.strip()
    assert a == b
    status = json.loads(run(fake_binary, pipe, log, stdin="fake_status\n").stdout)
    assert [s["uid"] for s in status["servers"]] == [0]


def test_die_fault_leaves_a_stale_pid_file_that_does_not_block_a_new_daemon(
    fake_binary: Path, dirs: tuple[Path, Path]
) -> None:
    pipe, log = dirs
    assert run(fake_binary, pipe, log, "-d").returncode == 0
    pid = int((pipe / PID_FILE_NAME).read_text())
    fault_path(pipe, "die").touch()
    wait_for(lambda: not pid_alive(pid), what="fake daemon to die")
    assert (pipe / PID_FILE_NAME).exists()
    assert run(fake_binary, pipe, log, stdin="get_server_list\n").returncode == 1
    assert run(fake_binary, pipe, log, "-d").returncode == 0
    new_pid = int((pipe / PID_FILE_NAME).read_text())
    assert new_pid != pid
    run(fake_binary, pipe, log, stdin="quit\n")
    kill_fake(new_pid)


def test_refuse_clients_fault_logs_the_cuda_error(
    fake_binary: Path,
    dirs: tuple[Path, Path],
    client_procs: Callable[[], int],
    start_daemon: Callable[..., None],
) -> None:
    pipe, log = dirs
    start_daemon()
    fault_path(pipe, "refuse-clients").touch()
    reply = run(
        fake_binary, pipe, log, stdin=f"fake_register_client {client_procs()} 1000\n"
    ).stdout
    assert "all CUDA-capable devices are busy or unavailable" in reply
    assert "all CUDA-capable devices are busy or unavailable" in (log / "control.log").read_text()


def test_client_cap_refuses_the_client_past_the_limit(
    fake_binary: Path,
    dirs: tuple[Path, Path],
    client_procs: Callable[[], int],
    start_daemon: Callable[..., None],
) -> None:
    pipe, log = dirs
    start_daemon(FAKE_MPS_MAX_CLIENTS="2")
    replies = [
        run(fake_binary, pipe, log, stdin=f"fake_register_client {pid} 1000\n").stdout.strip()
        for pid in (client_procs(), client_procs(), client_procs())
    ]
    assert replies[0].isdigit() and replies[1] == replies[0]
    # As the H100 recorded (tests/data/mps_gpu_check/20261128T022439Z-h100/, step 10):
    # CUDA error 808's text for the client, the cap named in the server's log.
    assert replies[2] == f"ERROR: {CLIENT_CAP_MESSAGE}"
    line = f"Server {replies[0]:>5}] " + CLIENT_CAP_LOG.format(cap=2)
    assert line in (log / "server.log").read_text()
    recorded = REAL_H100 / "server.log", REAL_H100 / "summary.txt"
    assert CLIENT_CAP_LOG.format(cap=48) in recorded[0].read_text()
    assert f"CUDA error 808 ({CLIENT_CAP_MESSAGE})" in recorded[1].read_text()


@pytest.mark.slow  # waits out real quit timeouts
def test_quit_waits_for_clients_and_quit_t_forces_the_servers_down(
    fake_binary: Path, dirs: tuple[Path, Path], client_procs: Callable[[], int]
) -> None:
    pipe, log = dirs
    assert run(fake_binary, pipe, log, "-d").returncode == 0
    pid = int((pipe / PID_FILE_NAME).read_text())
    client = client_procs()
    server = run(fake_binary, pipe, log, stdin=f"fake_register_client {client} 1000\n").stdout
    # A plain quit waits for the client: the front end does not return. Waiting on the
    # daemon's log line, not a fixed timeout, because on a busy machine the front end may
    # not have sent the command within any fixed time.
    front_end = subprocess.Popen(
        [str(fake_binary)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        env={"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
    )
    try:
        assert front_end.stdin is not None
        front_end.stdin.write("quit\n")
        front_end.stdin.close()
        wait_for(
            lambda: "Received quit" in (log / "control.log").read_text(),
            what="the fake daemon logs the quit",
        )
        assert front_end.poll() is None, "a plain quit returned with a client attached"
    finally:
        front_end.kill()
        front_end.wait()
    assert pid_alive(pid) and pid_alive(int(server))
    # ... and takes no new client meanwhile.
    refused = run(fake_binary, pipe, log, stdin=f"fake_register_client {client_procs()} 1000\n")
    assert "busy or unavailable" in refused.stdout
    forced = run(fake_binary, pipe, log, stdin="quit -t 0\n")
    assert forced.returncode == 0
    assert not pid_alive(pid) and not (pipe / PID_FILE_NAME).exists()
    assert f"Server {int(server)} exited with status 137" in (log / "control.log").read_text()


@pytest.mark.slow  # waits out real quit timeouts
def test_quit_returns_once_the_last_client_has_exited(
    fake_binary: Path, dirs: tuple[Path, Path]
) -> None:
    pipe, log = dirs
    assert run(fake_binary, pipe, log, "-d").returncode == 0
    pid = int((pipe / PID_FILE_NAME).read_text())
    client = subprocess.Popen(["sleep", "1"])
    try:
        run(fake_binary, pipe, log, stdin=f"fake_register_client {client.pid} 1000\n")
        result = run(fake_binary, pipe, log, stdin="quit\n")  # blocks about 1 s
        assert result.returncode == 0
        assert client.poll() is not None or client.wait(5) == 0
        assert not pid_alive(pid)
        assert "exited with status 0" in (log / "control.log").read_text()
    finally:
        client.kill()
        client.wait()


def test_start_server_of_another_user_waits_until_the_current_server_drains(
    fake_binary: Path, dirs: tuple[Path, Path], start_daemon: Callable[..., None]
) -> None:
    pipe, log = dirs
    client = subprocess.Popen(["sleep", "300"])
    start_daemon()
    try:
        run(fake_binary, pipe, log, stdin=f"fake_register_client {client.pid} 1000\n")
        run(fake_binary, pipe, log, stdin="start_server -uid 2000\n")

        def uids() -> list[int]:
            status = json.loads(run(fake_binary, pipe, log, stdin="fake_status\n").stdout)
            return [s["uid"] for s in status["servers"]]

        assert uids() == [1000]  # one user at a time: 2000 is queued
        client.kill()
        client.wait()
        wait_for(lambda: uids() == [2000], what="the queued user's server")
    finally:
        client.kill()
        client.wait()


def test_a_client_gets_the_servers_limit_lowered_never_raised_by_its_env(
    fake_binary: Path,
    dirs: tuple[Path, Path],
    client_procs: Callable[[], int],
    start_daemon: Callable[..., None],
) -> None:
    from migd.backends.simulated.mps_control import connect_client

    pipe, log = dirs
    start_daemon()
    run(fake_binary, pipe, log, stdin="set_default_device_pinned_mem_limit 0 2G\n")
    server, limit = connect_client(pipe, client_procs(), 1000) or (0, 0)
    assert limit == 2048  # no variable: the server's limit
    assert connect_client(pipe, client_procs(), 1000, "0=512MB") == (server, 512)
    # NVIDIA: a client value above the server's "will be ineffective"
    assert connect_client(pipe, client_procs(), 1000, "0=4096M") == (server, 2048)
    uuid = "GPU-11111111-2222-3333-4444-555555555555"
    assert connect_client(pipe, client_procs(), 1000, f"{uuid}=1G") == (server, 1024)
    run(fake_binary, pipe, log, stdin="quit -t 0\n")
    # No daemon: CUDA runs the program without MPS, and without any limit.
    assert connect_client(pipe, client_procs(), 1000, "0=512M") is None


def test_a_client_whose_process_exits_leaves_its_server(
    fake_binary: Path, dirs: tuple[Path, Path], start_daemon: Callable[..., None]
) -> None:
    pipe, log = dirs
    client = subprocess.Popen(["sleep", "300"])
    start_daemon()
    try:
        server = run(fake_binary, pipe, log, stdin=f"fake_register_client {client.pid} 1000\n")
        listed = run(fake_binary, pipe, log, stdin=f"get_client_list {server.stdout.strip()}\n")
        assert listed.stdout.split() == [str(client.pid)]
        client.kill()
        client.wait()
        wait_for(
            lambda: (
                run(
                    fake_binary, pipe, log, stdin=f"get_client_list {server.stdout.strip()}\n"
                ).stdout.strip()
                == ""
            ),
            what="the dead client to leave",
        )
    finally:
        client.kill()
        client.wait()
