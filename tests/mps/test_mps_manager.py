"""MpsManager's real code against the fake nvidia-cuda-mps-control."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from migd.backends.mps import (
    PID_FILE_NAME,
    RECORD_FILE_NAME,
    MpsBinaryNotFound,
    MpsDaemonStartFailed,
    MpsManager,
    RunAs,
)
from migd.backends.simulated.mps_control import fault_path
from migd.core.mps import MpsShare, UserPolicy
from migd.errors import MpsError
from tests.waiting import wait_for

from .conftest import Env, kill_fake, pid_alive

# Real fake-daemon processes, started and stopped per test (about 1.4 s each here).
pytestmark = pytest.mark.slow

GPU = "GPU-0a1b2c3d-0000-4000-8000-000000000001"
GPU2 = "GPU-0a1b2c3d-0000-4000-8000-000000000002"
MIG_LEGACY = "MIG-GPU-0a1b2c3d-0000-4000-8000-000000000001/1/0"


def share(share_id: str = "job-1", uid: int = 1000, memory_mib: int = 4096, **kw: int) -> MpsShare:
    return MpsShare(share_id=share_id, uid=uid, memory_mib=memory_mib, gid=kw.pop("gid", uid), **kw)


def fake_status(env: Env, manager: MpsManager, uuid: str = GPU) -> dict:
    return json.loads(env.control(manager.pipe_dir(uuid), "fake_status"))


def daemon_pid(manager: MpsManager, uuid: str = GPU) -> int:
    return int((manager.pipe_dir(uuid) / PID_FILE_NAME).read_text())


def register_client(
    env: Env, manager: MpsManager, client_pid: int, uid: int, uuid: str = GPU
) -> str:
    return env.control(manager.pipe_dir(uuid), f"fake_register_client {client_pid} {uid}").strip()


# -- start on demand, environment, limits -----------------------------------------------------


def test_daemon_starts_with_the_first_share_and_the_job_env_reaches_it(
    env: Env, client_procs: Callable[[], int]
) -> None:
    manager = env.manager()
    assert manager.start().adopted == ()
    assert not manager.pipe_dir(GPU).exists()
    job_env = manager.ensure_share(GPU, share(memory_mib=4096, thread_percentage=30))

    pipe = manager.pipe_dir(GPU)
    assert job_env == {
        "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(manager.log_dir(GPU, 1000)),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=4096M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_VISIBLE_DEVICES": GPU,
        "NVIDIA_VISIBLE_DEVICES": GPU,
    }
    assert pipe == env.runtime_dir / "mps" / GPU / "pipe"
    assert pid_alive(daemon_pid(manager))
    status = fake_status(env, manager)
    assert status["visible_devices"] == GPU
    assert status["multi_user"] is False
    # default limit for future servers and the pre-started server of the share's user
    assert status["default_pinned_limits"] == {"0": "4096M", GPU: "4096M"}
    assert [(s["uid"], s["pinned_limits"]) for s in status["servers"]] == [(1000, {"0": "4096M"})]
    # a client using the job's pipe dir reaches that very daemon and server
    assert register_client(env, manager, client_procs(), 1000) == str(status["servers"][0]["pid"])
    record = json.loads((manager.device_dir(GPU) / RECORD_FILE_NAME).read_text())
    assert (record["pid"], record["device_uuid"]) == (daemon_pid(manager), GPU)


def test_ensure_share_is_idempotent(env: Env) -> None:
    manager = env.manager()
    first = manager.ensure_share(GPU, share())
    pid = daemon_pid(manager)
    starts = len(env.runner.daemon_starts())
    assert manager.ensure_share(GPU, share()) == first
    assert daemon_pid(manager) == pid
    assert len(env.runner.daemon_starts()) == starts


def test_limits_follow_the_largest_active_share_on_default_and_running_server(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share("small", memory_mib=2048))
    manager.ensure_share(GPU, share("big", memory_mib=8192))
    status = fake_status(env, manager)
    assert status["default_pinned_limits"] == {"0": "8192M", GPU: "8192M"}
    assert [s["pinned_limits"] for s in status["servers"]] == [{"0": "8192M"}]
    (entry,) = manager.status()
    assert entry.default_limit_mib == 8192
    manager.release_share(GPU, "big")
    status = fake_status(env, manager)
    assert status["default_pinned_limits"] == {"0": "2048M", GPU: "2048M"}
    assert [s["pinned_limits"] for s in status["servers"]] == [{"0": "2048M"}]


def test_each_device_gets_its_own_daemon_and_pipe_dir(env: Env) -> None:
    manager = env.manager()
    a = manager.ensure_share(GPU, share("a"))
    b = manager.ensure_share(GPU2, share("b"))
    assert a["CUDA_MPS_PIPE_DIRECTORY"] != b["CUDA_MPS_PIPE_DIRECTORY"]
    assert daemon_pid(manager, GPU) != daemon_pid(manager, GPU2)
    assert fake_status(env, manager, GPU2)["visible_devices"] == GPU2


def test_legacy_mig_uuid_with_slashes_gets_a_flat_directory(env: Env) -> None:
    manager = env.manager()
    job_env = manager.ensure_share(MIG_LEGACY, share())
    assert manager.pipe_dir(MIG_LEGACY).parent.parent == env.runtime_dir / "mps"
    assert job_env["CUDA_VISIBLE_DEVICES"] == MIG_LEGACY
    assert fake_status(env, manager, MIG_LEGACY)["visible_devices"] == MIG_LEGACY


# -- users ------------------------------------------------------------------------------------


def test_per_user_daemon_runs_as_the_share_user_when_root(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share(uid=1000, gid=1001))
    ((argv, run_as),) = env.runner.daemon_starts()
    assert "-M" not in argv
    commands = {run_as for _argv, stdin, run_as in env.runner.calls if stdin}
    if os.geteuid() == 0:
        assert run_as == RunAs(1000, 1001)
        assert commands == {RunAs(1000, 1001)}  # commands reach the daemon as its own user
        assert manager.pipe_dir(GPU).stat().st_uid == 1000
        assert manager.pipe_dir(GPU).stat().st_mode & 0o777 == 0o700
    else:
        assert run_as is None and commands == {None}
        (entry,) = manager.status()
        assert entry.uid == os.geteuid()  # recorded: it ran as migd's own user


def test_idle_per_user_device_changes_hands_by_restarting_the_daemon(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share("a", uid=1000))
    old = daemon_pid(manager)
    with pytest.raises(MpsError, match="serves uid 1000"):
        manager.ensure_share(GPU, share("b", uid=2000))
    manager.release_share(GPU, "a")
    manager.ensure_share(GPU, share("b", uid=2000))
    wait_for(lambda: not pid_alive(old), what="old daemon to quit")
    assert [s["uid"] for s in fake_status(env, manager)["servers"]] == [2000]
    (entry,) = manager.status()
    assert entry.serves_uid == 2000


def test_multi_user_daemon_is_started_with_M_and_shares_one_server(
    env: Env, client_procs: Callable[[], int]
) -> None:
    manager = env.manager(policy=UserPolicy.MULTI_USER)
    manager.ensure_share(GPU, share("a", uid=1000))
    manager.ensure_share(GPU, share("b", uid=2000))
    ((argv, run_as),) = env.runner.daemon_starts()
    assert argv[-1] == "-M" and run_as is None
    status = fake_status(env, manager)
    assert status["multi_user"] is True
    assert register_client(env, manager, client_procs(), 1000) == register_client(
        env, manager, client_procs(), 2000
    )
    if os.geteuid() == 0:
        assert manager.pipe_dir(GPU).stat().st_mode & 0o777 == 0o755


# -- idle stop, shutdown ----------------------------------------------------------------------


def test_idle_daemon_is_stopped_after_the_idle_time_only(env: Env) -> None:
    manager = env.manager(idle_stop_s=60.0)
    manager.ensure_share(GPU, share())
    pid = daemon_pid(manager)
    env.clock.advance(3600)
    assert manager.stop_idle() == []  # busy: never idle-stopped
    manager.release_share(GPU, "job-1")
    env.clock.advance(59)
    assert manager.stop_idle() == []
    env.clock.advance(1)
    assert manager.stop_idle() == [GPU]
    wait_for(lambda: not pid_alive(pid), what="idle daemon to exit")
    assert not manager.pipe_dir(GPU).exists()
    assert not (manager.device_dir(GPU) / RECORD_FILE_NAME).exists()
    assert manager.status() == []


def test_shutdown_stops_own_daemons_only(env: Env, short_dir: Path) -> None:
    outside_pipe = short_dir / "elsewhere" / "pipe"
    started = subprocess.run(
        [str(env.binary), "-d"],
        env={
            "PATH": os.environ["PATH"],
            "CUDA_MPS_PIPE_DIRECTORY": str(outside_pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(short_dir / "elsewhere" / "log"),
        },
        timeout=60,
        check=False,
    )
    assert started.returncode == 0
    outside = int((outside_pipe / PID_FILE_NAME).read_text())
    try:
        manager = env.manager()
        manager.ensure_share(GPU, share())
        own = daemon_pid(manager)
        manager.shutdown()
        wait_for(lambda: not pid_alive(own), what="own daemon to exit")
        assert pid_alive(outside)
        assert env.control(outside_pipe, "get_server_list") == ""
    finally:
        env.control(outside_pipe, "quit")
        kill_fake(outside)


# -- health -----------------------------------------------------------------------------------


def test_crashed_server_is_detected_restarted_and_reported(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share())
    (old_server,) = (s["pid"] for s in fake_status(env, manager)["servers"])
    fault_path(manager.pipe_dir(GPU), "crash-server").touch()
    wait_for(lambda: not pid_alive(old_server), what="server crash")

    report = manager.check_health()
    assert report.affected_devices == (GPU,)
    assert report.failed_devices == ()
    (event,) = report.events
    assert (event.problem, event.action, event.ok) == ("server_crashed", "restarted_server", True)
    (new_server,) = (s["pid"] for s in fake_status(env, manager)["servers"])
    assert new_server != old_server and pid_alive(new_server)
    assert manager.check_health().events == ()


def test_server_killed_from_outside_is_noticed(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share())
    (server,) = (s["pid"] for s in fake_status(env, manager)["servers"])
    os.kill(server, signal.SIGKILL)
    wait_for(lambda: not pid_alive(server), what="server to die")
    (event,) = manager.check_health().events
    assert event.problem == "server_crashed" and event.ok


def test_dead_control_daemon_is_restarted_with_its_shares_and_limits(env: Env) -> None:
    manager = env.manager()
    job_env = manager.ensure_share(GPU, share(memory_mib=6144))
    old = daemon_pid(manager)
    fault_path(manager.pipe_dir(GPU), "die").touch()
    wait_for(lambda: not pid_alive(old), what="daemon to die")

    (event,) = manager.check_health().events
    assert (event.device_uuid, event.problem, event.action, event.ok) == (
        GPU,
        "daemon_gone",
        "restarted_daemon",
        True,
    )
    new = daemon_pid(manager)
    assert new != old and pid_alive(new)
    assert manager.ensure_share(GPU, share("job-1", memory_mib=6144)) == job_env
    status = fake_status(env, manager)
    assert status["default_pinned_limits"] == {"0": "6144M", GPU: "6144M"}
    assert len(status["servers"]) == 1


def test_daemon_refusing_its_only_client_is_restarted_at_no_cost(
    env: Env, client_procs: Callable[[], int]
) -> None:
    """Nobody connected and a client refused: the server is sick, and a restart loses
    nobody (issue 25: the event does not flag any lease)."""
    manager = env.manager()
    manager.ensure_share(GPU, share())
    old = daemon_pid(manager)
    fault_path(manager.pipe_dir(GPU), "refuse-clients").touch()
    assert "busy or unavailable" in register_client(env, manager, client_procs(), 1000)

    report = manager.check_health()
    (event,) = report.events
    assert (event.problem, event.action, event.ok, event.clients_lost) == (
        "devices_unavailable",
        "restarted_daemon",
        True,
        False,
    )
    assert report.affected_devices == ()
    assert "all CUDA-capable devices are busy or unavailable" in event.detail
    wait_for(lambda: not pid_alive(old), what="old daemon gone")
    assert register_client(env, manager, client_procs(), 1000).isdigit()


def test_a_client_past_the_cap_is_counted_and_restarts_nothing(
    env: Env, client_procs: Callable[[], int]
) -> None:
    """The cap (here 2) turns a third client away as the H100 did: CUDA error 808's text
    for the client, "Maximum number of clients (2) reached" in server.log. The device is
    full, not sick: no restart now or once the clients are gone, no lease flagged, and
    the cap the log names is what ``migctl status`` shows (and the books take)."""
    manager = env.manager(env={"PATH": os.environ["PATH"], "FAKE_MPS_MAX_CLIENTS": "2"})
    manager.ensure_share(GPU, share(memory_mib=4096))
    old = daemon_pid(manager)
    first, second = client_procs(), client_procs()
    assert register_client(env, manager, first, 1000).isdigit()
    assert register_client(env, manager, second, 1000).isdigit()
    refused = register_client(env, manager, client_procs(), 1000)
    assert "MPS client have been exhausted" in refused
    # the wrapper of the refused job reports it too; one event all the same
    manager.report_client_error(GPU, f"RuntimeError: CUDA error: {refused[len('ERROR: ') :]}")

    report = manager.check_health()
    (event,) = report.events
    assert (event.problem, event.action, event.ok, event.clients_lost) == (
        "client_cap",
        "none",
        True,
        False,
    )
    assert report.affected_devices == () and report.failed_devices == ()
    (entry,) = manager.status()
    assert (entry.refused_clients, entry.clients_at_refusal, entry.healthy) == (1, 2, True)
    env.control(manager.pipe_dir(GPU), f"fake_unregister_client {first}")
    env.control(manager.pipe_dir(GPU), f"fake_unregister_client {second}")
    assert manager.check_health().events == ()
    assert daemon_pid(manager) == old and pid_alive(old)


def test_a_refused_client_never_restarts_a_daemon_that_serves_others(
    env: Env, client_procs: Callable[[], int]
) -> None:
    """Issue 25: a device that refuses a third client with "busy or unavailable" (what
    k8s users saw below the cap, and a sick server says) keeps serving the two, no lease
    is flagged; it is restarted only once they are gone."""
    manager = env.manager()
    manager.ensure_share(GPU, share(memory_mib=4096))
    old = daemon_pid(manager)
    first, second = client_procs(), client_procs()
    assert register_client(env, manager, first, 1000).isdigit()
    assert register_client(env, manager, second, 1000).isdigit()
    fault_path(manager.pipe_dir(GPU), "refuse-clients").touch()
    assert "busy or unavailable" in register_client(env, manager, client_procs(), 1000)
    fault_path(manager.pipe_dir(GPU), "refuse-clients").unlink()
    # the wrapper of the refused job reports it too
    manager.report_client_error(
        GPU, "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable"
    )

    report = manager.check_health()
    (event,) = report.events
    assert (event.problem, event.action, event.ok, event.clients_lost) == (
        "devices_unavailable",
        "none",
        True,
        False,
    )
    assert "2 client(s) connected" in event.detail and report.affected_devices == ()
    assert daemon_pid(manager) == old and pid_alive(old)
    (entry,) = manager.status()
    assert (entry.refused_clients, entry.clients_at_refusal) == (1, 2)
    assert sorted(fake_status(env, manager)["servers"][0]["clients"]) == sorted([first, second])
    # Later checks leave it alone while the clients run...
    assert manager.check_health().events == ()
    assert daemon_pid(manager) == old
    # ...and restart it once they are gone, at no cost.
    env.control(manager.pipe_dir(GPU), f"fake_unregister_client {first}")
    env.control(manager.pipe_dir(GPU), f"fake_unregister_client {second}")
    (event,) = manager.check_health().events
    assert (event.action, event.clients_lost) == ("restarted_daemon", False)
    assert daemon_pid(manager) != old


def test_a_client_report_of_unavailable_devices_restarts_an_idle_daemon_only(
    env: Env,
) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share())
    old = daemon_pid(manager)
    manager.report_client_error(GPU, "CUDA error: out of memory")  # not an MPS failure
    assert manager.check_health().events == ()
    manager.report_client_error(
        GPU, "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable"
    )
    (event,) = manager.check_health().events
    assert (event.problem, event.action, event.ok, event.clients_lost) == (
        "devices_unavailable",
        "restarted_daemon",
        True,
        False,
    )
    assert daemon_pid(manager) != old


def test_hung_daemon_is_killed_and_replaced(env: Env) -> None:
    # The hang costs one command timeout; 5 s keeps a slow, loaded host's healthy replacement
    # from being taken for a hung one on the check after it.
    manager = env.manager(command_timeout_s=5.0)
    manager.ensure_share(GPU, share())
    old = daemon_pid(manager)
    fault_path(manager.pipe_dir(GPU), "hang").touch()

    (event,) = manager.check_health().events
    assert (event.problem, event.action, event.ok) == (
        "daemon_unresponsive",
        "restarted_daemon",
        True,
    )
    assert not pid_alive(old)
    assert pid_alive(daemon_pid(manager))
    assert manager.check_health().events == ()


def test_ensure_share_replaces_a_daemon_that_died_between_checks(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share("a"))
    old = daemon_pid(manager)
    fault_path(manager.pipe_dir(GPU), "die").touch()
    wait_for(lambda: not pid_alive(old), what="daemon to die")
    manager.ensure_share(GPU, share("b"))
    assert daemon_pid(manager) != old
    assert manager.status()[0].shares == 2


# -- restart of migd: adopt or clean ----------------------------------------------------------


def test_new_manager_adopts_live_daemons_and_cleans_stale_ones(env: Env) -> None:
    first = env.manager()
    first.ensure_share(GPU, share("a"))
    first.ensure_share(GPU2, share("b"))
    live = daemon_pid(first, GPU)
    dead = daemon_pid(first, GPU2)
    fault_path(first.pipe_dir(GPU2), "die").touch()
    wait_for(lambda: not pid_alive(dead), what="daemon to die")
    # A pid file naming a live process that is not an MPS daemon (PID reuse): this test.
    reused = env.runtime_dir / "mps" / "GPU-reused" / "pipe"
    reused.mkdir(parents=True)
    (reused / PID_FILE_NAME).write_text(f"{os.getpid()}\n")
    env.managers.remove(first)  # migd "crashed": no shutdown

    second = env.manager()
    report = second.start()
    assert report.adopted == (GPU,)
    assert sorted(Path(p).name for p in report.cleaned) == sorted([GPU2, "GPU-reused"])
    assert report.lost == (GPU2,)  # its recorded daemon died while migd was down
    assert not second.pipe_dir(GPU2).exists() and not reused.exists()
    assert pid_alive(os.getpid())
    (entry,) = second.status()
    assert (entry.device_uuid, entry.pid, entry.healthy, entry.shares) == (GPU, live, True, 0)
    second.ensure_share(GPU, share("a"))  # the daemon re-registers its lease
    assert daemon_pid(second, GPU) == live
    second.shutdown()
    wait_for(lambda: not pid_alive(live), what="adopted daemon to stop")


# -- status and errors ------------------------------------------------------------------------


def test_status_shows_servers_clients_and_limits(env: Env, client_procs: Callable[[], int]) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share(memory_mib=3072))
    clients = sorted([client_procs(), client_procs()])
    for pid in clients:
        register_client(env, manager, pid, 1000)
    (entry,) = manager.status()
    data = entry.to_dict()
    assert data["device_uuid"] == GPU and data["healthy"] is True
    assert data["pid"] == daemon_pid(manager)
    assert len(data["servers"]) == 1 and data["clients"] == clients
    # Newer drivers print limits >= 1 GiB as whole G, rounded down: 3072M reads as 3G.
    assert data["default_limit_mib"] == 3072
    assert data["pipe_dir"] == str(manager.pipe_dir(GPU)) and data["shares"] == 1
    assert data["idle_for_s"] is None
    json.dumps(data)


def test_missing_binary_is_a_clear_error(env: Env) -> None:
    manager = env.manager(binary=str(env.runtime_dir / "no-such-mps-control"))
    with pytest.raises(MpsBinaryNotFound) as info:
        manager.ensure_share(GPU, share())
    assert "not found" in info.value.message and info.value.hint


def test_too_long_socket_path_is_refused_before_starting(env: Env, tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 80)
    manager = MpsManager(deep)
    with pytest.raises(MpsDaemonStartFailed, match="longer than 107 bytes"):
        manager.ensure_share(GPU, share())


# -- the daemon's call sites (migd.daemon.service) --------------------------------------------


def test_daemon_facing_methods_work_with_the_schedulers_lease_and_gpu(env: Env) -> None:
    from migd.core.gpus import ManagedGpu, MpsState
    from migd.core.leases import Lease, LeaseRequest

    gpu = ManagedGpu(
        index=0,
        uuid=GPU,
        model="H100-80GB",
        name="H100",
        memory_total_mib=81559,
        state=MpsState(),
    )
    lease = Lease(
        lease_id="L1",
        request=LeaseRequest(job_id="1.0", memory_mib=5000),
        owner_uid=1000,
        owner_pid=os.getpid(),
        created_s=0.0,
        memory_limit_mib=6144,
    )
    manager = env.manager()
    promised = manager.client_env(GPU, lease)  # at grant time, before any daemon runs
    assert not manager.pipe_dir(GPU).exists()
    assert promised["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"
    assert manager.ensure_share(gpu.uuid, manager.share_for(lease)) == promised
    assert fake_status(env, manager)["default_pinned_limits"] == {"0": "6144M", GPU: "6144M"}
    (entry,) = manager.status_for(GPU)
    assert entry["shares"] == 1 and entry["device_uuid"] == GPU
    assert manager.status_for(GPU2) == []
    manager.release_share(GPU, "L1")
    assert manager.status_for(GPU)[0]["shares"] == 0


def test_shutdown_keeps_daemons_of_devices_with_running_jobs(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share("busy"))
    manager.ensure_share(GPU2, share("idle"))
    kept, stopped = daemon_pid(manager, GPU), daemon_pid(manager, GPU2)
    manager.shutdown(keep={GPU})
    wait_for(lambda: not pid_alive(stopped), what="unkept daemon to stop")
    assert pid_alive(kept)
    successor = env.manager()
    assert successor.start().adopted == (GPU,)


# -- fidelity fixes: limits by index, normal exits, empty command lines, per-user logs ---------


def test_the_default_limit_is_set_by_uuid_and_by_index_and_the_server_by_index(
    env: Env,
) -> None:
    # Issue 25: on an H200 the default set by UUID was the one clients got, while
    # NVIDIA/k8s-device-plugin#572 saw UUID limits not apply: both, to one value.
    manager = env.manager()
    manager.ensure_share(GPU, share(memory_mib=2048))
    sent = "".join(stdin or "" for _argv, stdin, _as in env.runner.calls)
    assert f"set_default_device_pinned_mem_limit {GPU} 2048M" in sent
    assert "set_default_device_pinned_mem_limit 0 2048M" in sent
    assert f"get_default_device_pinned_mem_limit {GPU}" in sent
    assert "set_device_pinned_mem_limit" not in sent.replace("set_default_device", "")
    manager.ensure_share(GPU, share("b", memory_mib=3000))  # a running server now
    sent = "".join(stdin or "" for _argv, stdin, _as in env.runner.calls)
    (server,) = (s["pid"] for s in fake_status(env, manager)["servers"])
    assert f"set_device_pinned_mem_limit {server} 0 3072M" in sent


def test_a_server_that_exits_normally_is_not_a_crash(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share())
    (server,) = (s["pid"] for s in fake_status(env, manager)["servers"])
    env.control(manager.pipe_dir(GPU), f"shutdown_server {server}")  # exits with status 0
    wait_for(lambda: not pid_alive(server), what="server to exit")
    report = manager.check_health()
    assert report.affected_devices == () and report.events == ()


def test_an_empty_command_line_is_not_an_mps_daemon() -> None:
    from migd.backends.mps.procs import looks_like_mps, looks_like_mps_control

    child = subprocess.Popen(["true"])
    wait_for(lambda: Path(f"/proc/{child.pid}/cmdline").read_bytes() == b"", what="a zombie")
    try:
        assert not looks_like_mps_control(child.pid) and not looks_like_mps(child.pid)
    finally:
        child.wait()


def test_each_user_has_their_own_log_directory(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(GPU, share("a", uid=1000))
    first_log = Path(manager.status()[0].log_dir)
    assert first_log == manager.log_dir(GPU, 1000) and (first_log / "control.log").exists()
    manager.release_share(GPU, "a")
    manager.ensure_share(GPU, share("b", uid=2000))
    second_log = Path(manager.status()[0].log_dir)
    assert second_log == manager.log_dir(GPU, 2000) != first_log
    assert (second_log / "control.log").exists()
    if os.geteuid() == 0:
        # the next user's daemon gets nothing of the last one's: owners stay as they were
        assert first_log.stat().st_uid == 1000 and second_log.stat().st_uid == 2000
        assert (first_log / "control.log").stat().st_uid != 2000
        assert first_log.stat().st_mode & 0o777 == 0o700


# -- status without blocking ------------------------------------------------------------------


def test_cached_status_answers_at_once_while_the_daemon_hangs(env: Env) -> None:
    manager = env.manager(command_timeout_s=2.0)
    manager.ensure_share(GPU, share())
    (early,) = manager.cached_status_for(GPU)  # before any refresh: migd's own record
    assert early["age_s"] is None and early["pid"] == daemon_pid(manager)
    manager.refresh_status()
    env.clock.mono += 7.0
    (fresh,) = manager.cached_status_for(GPU)
    assert fresh["age_s"] == 7.0 and len(fresh["servers"]) == 1
    assert manager.client_count(GPU) == 0
    fault_path(manager.pipe_dir(GPU), "hang").touch()
    sent = len(env.runner.calls)
    (cached,) = manager.cached_status_for(GPU)
    # the answer comes from the cache: no command went to the hung daemon, so nothing could
    # wait on it (a property, where a time bound would depend on the host's load)
    assert len(env.runner.calls) == sent and cached["servers"] == fresh["servers"]
    with pytest.raises(MpsError):
        manager.client_count(GPU)


# -- systemd: each daemon in its own scope ----------------------------------------------------


def write_systemd_run(bin_dir: Path, log: Path, *, fail: bool = False) -> None:
    """A stand-in systemd-run: records its argv, then runs the command after ``--``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "systemd-run"
    body = (
        "echo 'Failed to start transient scope unit' >&2; exit 1"
        if fail
        else ('while [ "$1" != "--" ]; do shift; done; shift; exec "$@"')
    )
    script.write_text(f'#!/bin/sh\necho "$@" >> {log}\n{body}\n')
    script.chmod(0o755)


def test_under_systemd_each_daemon_starts_in_its_own_scope(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir, log = env.runtime_dir / "sdbin", env.runtime_dir / "systemd-run.log"
    write_systemd_run(bin_dir, log)
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    manager = env.manager(env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    manager.ensure_share(GPU, share(uid=1000))
    ((argv, run_as),) = env.runner.daemon_starts()
    unit = next(a for a in argv if a.startswith("--unit="))[len("--unit=") :]
    assert argv[:4] == ("systemd-run", "--scope", "--collect", "--quiet")
    assert unit.startswith("migd-mps-gpu-0a1b2c3d-")
    assert argv[argv.index("--") + 1 :] == (str(env.binary), "-d")
    if os.geteuid() == 0:  # systemd-run switches to the job's user, not the runner
        assert "--uid=1000" in argv and "--gid=1000" in argv and run_as is None
    assert log.read_text().split()[:3] == ["--scope", "--collect", "--quiet"]
    (entry,) = manager.status()
    assert entry.scope_unit == unit and entry.healthy


def test_without_systemd_or_when_systemd_run_fails_the_daemon_starts_plainly(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir, log = env.runtime_dir / "sdbin", env.runtime_dir / "systemd-run.log"
    write_systemd_run(bin_dir, log, fail=True)
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    plain = env.manager(env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    plain.ensure_share(GPU, share())
    assert env.runner.daemon_starts()[0][0][0] == str(env.binary)  # not under systemd
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    fallback = env.manager(env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    fallback.ensure_share(GPU2, share())
    starts = [argv for argv, _ in env.runner.daemon_starts()[1:]]
    assert starts[0][0] == "systemd-run" and starts[-1][0] == str(env.binary)
    (entry,) = [e for e in fallback.status() if e.device_uuid == GPU2]
    assert entry.scope_unit == "" and "systemd scope" in entry.last_error
