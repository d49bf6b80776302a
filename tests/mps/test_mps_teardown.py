"""Issue 13 defect 2: tearing down an MPS device waits, bounded, for its server to leave
NVML's process list (the server is a compute process on the device until it exits)."""

from __future__ import annotations

import json
import os

import pytest

from migd.backends.mps import MpsDeviceBusy, MpsServerStillRunning
from migd.core.mps import MpsShare
from migd.errors import GpuBusy

from .conftest import Env, pid_alive

MIG = "MIG-0a1b2c3d-0000-4000-8000-0000000000b1"


def share(share_id: str = "job-1") -> MpsShare:
    return MpsShare(share_id=share_id, uid=1000, memory_mib=1024, gid=1000)


def server_of(env: Env, pipe_dir: object) -> int:
    (server,) = (s["pid"] for s in json.loads(env.control(pipe_dir, "fake_status"))["servers"])
    return int(server)


def test_teardown_waits_until_the_server_is_gone_from_the_device(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(MIG, share())
    server = server_of(env, manager.pipe_dir(MIG))
    manager.release_share(MIG, "job-1")
    # NVML still lists the server for a few polls after quit returned.
    listings = iter([[server, 4242], [server], [server]])
    seen: list[list[int]] = []

    def device_pids() -> list[int]:
        seen.append(next(listings, []))
        return seen[-1]

    manager.stop_for_teardown(MIG, device_pids)

    assert seen[-1] == [] and len(seen) == 4
    assert not manager.manages(MIG)
    assert not pid_alive(server)


def test_a_server_that_stays_on_the_device_is_a_clear_error(env: Env) -> None:
    manager = env.manager(server_exit_timeout_s=0.2)
    manager.ensure_share(MIG, share())
    server = server_of(env, manager.pipe_dir(MIG))
    manager.release_share(MIG, "job-1")

    with pytest.raises(MpsServerStillRunning, match=rf"{server} still run on {MIG}") as caught:
        manager.stop_for_teardown(MIG, lambda: [server])

    assert isinstance(caught.value, GpuBusy)  # the daemon retries the destroy later
    assert caught.value.hint


def test_a_device_with_clients_is_not_torn_down(env: Env) -> None:
    manager = env.manager()
    manager.ensure_share(MIG, share())
    server = server_of(env, manager.pipe_dir(MIG))
    # A client the fake sees as live: this test process.
    env.control(manager.pipe_dir(MIG), f"fake_register_client {os.getpid()} 1000")

    with pytest.raises(MpsDeviceBusy, match="client"):
        manager.stop_for_teardown(MIG, list)

    assert manager.manages(MIG) and pid_alive(server)
    # The client leaves, as a job's CUDA context does at exit: the fixture's teardown then
    # stops the daemon at once instead of waiting out the fake's grace for live clients.
    env.control(manager.pipe_dir(MIG), f"fake_unregister_client {os.getpid()}")


def test_a_device_without_a_daemon_returns_at_once(env: Env) -> None:
    env.manager().stop_for_teardown(MIG, lambda: pytest.fail("NVML need not be asked"))


def test_watchers_learn_of_each_server_the_manager_starts(env: Env) -> None:
    manager = env.manager()
    seen: list[tuple[str, frozenset[int]]] = []
    manager.watch_servers(lambda uuid, pids: seen.append((uuid, frozenset(pids))))
    manager.watch_servers(lambda uuid, pids: 1 / 0)  # a broken watcher changes nothing
    manager.ensure_share(MIG, share())
    server = server_of(env, manager.pipe_dir(MIG))
    assert seen == [(MIG, frozenset({server}))]
