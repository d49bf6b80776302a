"""DCGM exporter's job mapping files written from the leases (format: NVIDIA/dcgm-exporter
hpc.go: files named <gpu> or <gpu>.<gi>, one job id per line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog.testing

from migd.core.gpus import ManagedGpu, MpsState
from migd.core.leases import LeaseState
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import validate_config
from migd.daemon.metrics.job_mapping import JobMappingWriter, job_mapping
from migd.daemon.metrics.service import MetricsService
from tests.metrics.conftest import finish, gpu, lease


def files(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(directory.iterdir())}


def test_mig_leases_map_to_gpu_dot_gi_and_mps_shares_list_every_job() -> None:
    v100 = ManagedGpu(1, "GPU-0001", "V100-32GB", "Tesla V100", 32768, MpsState())
    node = NodeScheduler([gpu(0), v100])
    mig = node.submit(lease(9000, gpu_uuids=("GPU-0000",)), 1.0, 1.0)
    finish(node, mig.work, 2.0)
    shares = [node.submit(lease(2000, gpu_uuids=("GPU-0001",)), 3.0, 3.0) for _ in range(2)]
    for out in shares:
        finish(node, out.work, 4.0)
    assert all(o.lease.state is LeaseState.ACTIVE for o in (mig, *shares))
    inst = node.gpus[0].instance_of(mig.lease.lease_id)
    assert inst is not None and inst.gi_id is not None
    assert job_mapping(node) == {
        f"0.{inst.gi_id}": [mig.lease.request.job_id],
        "1": [o.lease.request.job_id for o in shares],
    }


def test_mps_inside_mig_maps_to_the_host_instance() -> None:
    node = NodeScheduler([gpu(0, mps_in_mig=True)])
    out = node.submit(lease(1000), 1.0, 1.0)
    finish(node, out.work, 2.0)
    assert out.lease.state is LeaseState.ACTIVE and out.lease.mode == "mps"
    host = next(i for i in node.gpus[0].instances if i.mps_pool is not None)
    assert job_mapping(node) == {f"0.{host.gi_id}": [out.lease.request.job_id]}


def test_queued_and_ended_leases_are_not_mapped() -> None:
    node = NodeScheduler([gpu(0)])
    out = node.submit(lease(9000), 1.0, 1.0)
    assert out.lease.state is LeaseState.PREPARING
    assert job_mapping(node) == {}
    finish(node, out.work, 2.0)
    node.release(out.lease.lease_id, 3.0, 3.0)
    assert job_mapping(node) == {}


def test_the_writer_keeps_the_directory_equal_to_the_mapping(tmp_path: Path) -> None:
    directory = tmp_path / "map"
    directory.mkdir()
    (directory / "3.2").write_text("stale.0\n")  # from before a restart
    (directory / "README").write_text("not ours\n")
    writer = JobMappingWriter(directory)
    writer.sync({"0.7": ["12.0"], "1": ["13.0", "14.0"]})
    assert files(directory) == {"0.7": "12.0\n", "1": "13.0\n14.0\n", "README": "not ours\n"}
    writer.sync({"1": ["14.0"]})
    assert files(directory) == {"1": "14.0\n", "README": "not ours\n"}
    (directory / "1").unlink()  # someone removed it: a fresh writer (restart) puts it back
    JobMappingWriter(directory).sync({"1": ["14.0"]})
    assert files(directory) == {"1": "14.0\n", "README": "not ours\n"}


def test_an_unwritable_directory_is_logged_and_retried(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    writer = JobMappingWriter(blocker / "map")  # under a file: mkdir fails
    writer.sync({"0": ["1.0"]})  # no exception
    blocker.unlink()
    blocker.mkdir()
    writer.sync({"0": ["1.0"]})
    assert files(blocker / "map") == {"0": "1.0\n"}


def test_the_service_syncs_on_grants_and_ends(tmp_path: Path) -> None:
    import asyncio

    from tests.metrics.test_metrics import Source

    config = validate_config({"metrics": {"dcgm_job_mapping_dir": str(tmp_path)}})
    node = NodeScheduler([gpu(0)])
    service = MetricsService(config)
    asyncio.run(service.start(Source(node)))
    out = node.submit(lease(9000), 1.0, 1.0)
    finish(node, out.work, 2.0)
    service.on_transition(out.lease, LeaseState.PREPARING, LeaseState.ACTIVE, 2.0)
    assert list(files(tmp_path).values()) == [f"{out.lease.request.job_id}\n"]
    node.release(out.lease.lease_id, 3.0, 3.0)
    service.on_transition(out.lease, LeaseState.ACTIVE, LeaseState.RELEASED, 3.0)
    assert files(tmp_path) == {}


# -- issue 23, section 3: a directory a user can write is no way to make root write elsewhere --


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim"
    victim.write_text("root's secret\n")
    victim.chmod(0o600)
    return victim


def _intact(victim: Path) -> bool:
    return victim.read_text() == "root's secret\n" and (victim.stat().st_mode & 0o777) == 0o600


def test_planted_symlinks_are_replaced_not_written_through(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    directory = tmp_path / "map"
    directory.mkdir(mode=0o1777)  # sticky and world-writable, like /tmp
    directory.chmod(0o1777)
    # a user plants links where migd writes: the file, its temporary name, a stale name
    for name in ("0.1", ".0.1.tmp", ".1.tmp", "7"):
        (directory / name).symlink_to(victim)
    writer = JobMappingWriter(directory)
    writer.sync({"0.1": ["7.0"], "1": ["8.0"]})
    assert _intact(victim)
    assert files(directory) == {"0.1": "7.0\n", "1": "8.0\n"}  # the stale link "7" is gone
    assert not any(p.is_symlink() for p in directory.iterdir())
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in directory.iterdir())


def test_a_directory_others_can_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    victim = _victim(tmp_path)
    directory = tmp_path / "map"
    directory.mkdir()
    directory.chmod(0o777)
    (directory / "0.1").symlink_to(victim)
    with structlog.testing.capture_logs() as logs:
        JobMappingWriter(directory).sync({"0.1": ["7.0"]})
    assert _intact(victim) and (directory / "0.1").is_symlink()
    (failed,) = [e for e in logs if e["event"] == "job_mapping.write_failed"]
    assert "writable by others" in failed["error"] and "chmod 0755" in failed["hint"]


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir()
    (tmp_path / "map").symlink_to(real)
    with structlog.testing.capture_logs() as logs:
        JobMappingWriter(tmp_path / "map").sync({"0": ["7.0"]})
    assert list(real.iterdir()) == []
    assert [e for e in logs if e["event"] == "job_mapping.write_failed"]


def test_another_users_directory_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    directory = tmp_path / "map"
    directory.mkdir(mode=0o755)
    os.chown(directory, 4242, 4242)
    with structlog.testing.capture_logs() as logs:
        JobMappingWriter(directory).sync({"0": ["7.0"]})
    assert list(directory.iterdir()) == []
    (failed,) = [e for e in logs if e["event"] == "job_mapping.write_failed"]
    assert "uid 4242" in failed["error"]
