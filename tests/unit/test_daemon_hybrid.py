"""The daemon builds the hybrid policy from its config and runs it on simulated GPUs."""

from __future__ import annotations

from migd.backends.accounts import SystemAccounts
from migd.backends.procs import PsutilProcessTable
from migd.backends.simulated import simulated_backend
from migd.core.gpus import GpuMode
from migd.core.hybrid import ShareRule
from migd.core.leases import Lease, LeaseRequest, LeaseState
from migd.core.planner import CreateOp
from migd.core.scheduler import NodeScheduler
from migd.daemon.config import MigdConfig
from migd.daemon.service import Daemon, scheduler_policy


def _config(**gpu: object) -> MigdConfig:
    return MigdConfig.model_validate({"gpu": [{"match": "*", "mode": "hybrid", **gpu}]})


def test_mode_hybrid_makes_mig_gpus_with_mps_hosts_and_the_policy() -> None:
    config = _config(share="opt-in")
    policy = scheduler_policy(config)
    assert policy.hybrid is not None and policy.hybrid.rule is ShareRule.OPT_IN
    assert policy.hybrid.reserve_mib == config.mps.reserve_mib
    assert scheduler_policy(MigdConfig()).hybrid is None


def test_the_daemon_runs_the_hybrid_on_simulated_gpus() -> None:
    backend, _node = simulated_backend("2xA100-40GB")
    config = _config()
    daemon = Daemon(config, backend, PsutilProcessTable(), accounts=SystemAccounts())
    managed = [daemon.reconciler.manage(info) for info in backend.discover()]
    assert all(g.mode is GpuMode.MIG and g.mps_in_mig and g.available for g in managed)
    sched = NodeScheduler(managed, scheduler_policy(config))
    small = Lease("a", LeaseRequest("a", 3000, wait_s=60.0), 1000, 1, 0.0)
    big = Lease("b", LeaseRequest("b", 15000, wait_s=60.0), 1000, 1, 0.0)
    work = sched.submit(small, 0.0, 0.0).work + sched.submit(big, 0.0, 0.0).work
    for w in work:
        created = {
            op.start: (op.start + 1, f"MIG-{w.gpu}-{op.start}", op.profile.memory_mib)
            for op in w.ops
            if isinstance(op, CreateOp)
        }
        sched.work_done(w, created, 1.0, 1.0)
    assert small.state is LeaseState.ACTIVE and small.mode == "mps" and small.mig_uuid
    assert small.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=3000M"
    assert big.state is LeaseState.ACTIVE and big.mode == "mig"
    assert small.decision is not None and small.decision["reason"].startswith("hybrid:")
