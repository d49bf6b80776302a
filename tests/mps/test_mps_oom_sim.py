"""A client past its pinned limit is an OOM: MPS accounting + job env on the simulated node.

The simulated node (``migd.backends.simulated``) enforces an MPS client's pinned-memory
limit where ``cudaMalloc`` would fail. The client here gets its device and limit only
from the environment migd hands the job, as a CUDA program would.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from migd.backends.simulated import SimNode, SimOutOfMemory
from migd.backends.simulated.mps_control import connect_client
from migd.core import catalog
from migd.core.mps import (
    MpsPool,
    MpsRequest,
    admit,
    max_clients_for,
    parse_limit_mib,
    share_environment,
)

from .conftest import Env


def client_limit_mib(env: dict[str, str]) -> int:
    """What CUDA reads from ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for device 0."""
    limits = dict(item.split("=", 1) for item in env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split(","))
    value = parse_limit_mib(limits["0"])
    assert value is not None
    return value


def start_client(node: SimNode, pid: int, env: dict[str, str]) -> None:
    node.attach(pid, env["CUDA_VISIBLE_DEVICES"], mps_pinned_limit_mib=client_limit_mib(env))


def test_client_over_its_limit_gets_oom_while_its_neighbour_keeps_running() -> None:
    node = SimNode.from_description("1xV100-32GB")
    gpu = node.gpu(0)
    total, _used = node.memory_mib(0)
    pool = MpsPool(device_uuid=gpu.uuid, memory_total_mib=total, reserve_mib=512)
    big = MpsRequest("big", uid=1000, memory_mib=8192)
    small = MpsRequest("small", uid=1000, memory_mib=4096)
    pool = admit(admit(pool, big), small)
    env_big = share_environment(big, "/run/migd/mps/x/pipe", gpu.uuid)
    env_small = share_environment(small, "/run/migd/mps/x/pipe", gpu.uuid)

    start_client(node, 101, env_big)
    start_client(node, 102, env_small)
    node.alloc(101, 8192)  # exactly its share: fine
    with pytest.raises(SimOutOfMemory) as info:
        node.alloc(101, 1)
    assert (info.value.limit_mib, info.value.limit) == (8192, "MPS pinned-memory limit")
    assert "out of memory" in str(info.value)
    node.alloc(102, 4096)  # the neighbour still gets all of its share
    assert node.memory_mib(0)[1] == 8192 + 4096 <= pool.capacity_mib


def test_client_that_drops_its_env_is_bounded_by_the_daemon_default(
    env: Env, client_procs: Callable[[], int]
) -> None:
    # migd sets the daemon's limit to the largest active share; a client that unsets
    # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT gets that from the server, not the whole GPU. The
    # limit comes from the (stand-in) MPS server the client connects to, as in CUDA.
    node = SimNode.from_description("1xV100-32GB")
    gpu = node.gpu(0)
    manager = env.manager()
    job_env = manager.ensure_share(gpu.uuid, MpsRequest("a", 1000, 2048, gid=1000))
    manager.ensure_share(gpu.uuid, MpsRequest("b", 1000, 6144, gid=1000))
    pipe = job_env["CUDA_MPS_PIPE_DIRECTORY"]

    dropped = connect_client(pipe, client_procs(), 1000)  # no variable
    assert dropped is not None and dropped[1] == 6144
    node.attach(201, gpu.uuid, mps_pinned_limit_mib=dropped[1])
    node.alloc(201, 6144)
    with pytest.raises(SimOutOfMemory):
        node.alloc(201, 1)

    kept = connect_client(pipe, client_procs(), 1000, job_env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"])
    assert kept is not None and kept[1] == 2048  # its own share, lower than the server's
    manager.release_share(gpu.uuid, "b")
    later = connect_client(pipe, client_procs(), 1000)
    assert later is not None and later[1] == 2048  # new clients see the lowered limit


def test_mps_on_a_mig_device_is_bounded_by_the_share_limit_and_the_instance() -> None:
    node = SimNode.from_description('[[gpu]]\nmodel = "A100-40GB"\ninstances = [["3g.20gb", 4]]\n')
    (view,) = node.instances(0)
    (mig_uuid,) = view.uuids
    profile = catalog.geometry("A100-40GB").profile("3g.20gb")
    pool = MpsPool(
        device_uuid=mig_uuid,
        memory_total_mib=profile.memory_mib,
        reserve_mib=256,
        max_clients=max_clients_for(48, compute_slices=3, total_compute_slices=7),
    )
    share = MpsRequest("m", uid=1000, memory_mib=4096)
    pool = admit(pool, share)
    env = share_environment(share, "/run/migd/mps/m/pipe", mig_uuid)
    assert env["CUDA_VISIBLE_DEVICES"] == mig_uuid
    start_client(node, 301, env)
    node.alloc(301, 4096)
    with pytest.raises(SimOutOfMemory) as info:
        node.alloc(301, 512)
    assert info.value.device_uuid == mig_uuid and info.value.limit_mib == 4096
