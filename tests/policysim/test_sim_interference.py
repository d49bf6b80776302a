"""The calibrated MPS model and MPS inside MIG instances in the simulator."""

from __future__ import annotations

from dataclasses import replace

import pytest

from migd.core.catalog import geometry
from migd.errors import InvalidRequest
from migd.policysim.engine import PolicySimConfig, simulate
from migd.policysim.interference import CALIBRATED, MpsInterference, fit_kit
from migd.policysim.jobs import WorkloadJob
from migd.policysim.metrics import area_bounds, compute_metrics
from migd.policysim.policies import named_policy
from migd.policysim.workloads import kit_mix, pool_stream, workload


def test_processor_sharing_until_the_device_is_full() -> None:
    model = MpsInterference()
    assert model.shares([0.2, 0.3]) == pytest.approx([0.2, 0.3])  # room for both
    assert model.shares([0.6, 0.6]) == pytest.approx([0.5, 0.5])  # 1.2 asked of 1
    # a 3-slice instance of a 7-slice GPU offers 3/7
    assert sum(model.shares([0.3, 0.3], capacity=3 / 7)) == pytest.approx(3 / 7)


def test_contention_grows_with_clients_and_busyness() -> None:
    model = MpsInterference(kappa=0.1)
    idle = model.slowdown(2, 0.05)  # device 10 % busy
    busy = model.slowdown(2, 0.5)  # device full
    assert 1.0 < idle < busy
    assert model.slowdown(4, 0.25) > model.slowdown(2, 0.5)


def test_more_clients_than_one_server_manages_slow_everyone() -> None:
    model = MpsInterference(server_clients=48)
    assert model.slowdown(96, 0.001) == pytest.approx(2.0)
    with pytest.raises(InvalidRequest):
        MpsInterference(kappa=-1)


def test_the_fit_reproduces_the_published_points_it_uses() -> None:
    fit = fit_kit()
    assert fit.model == CALIBRATED
    assert fit.demand == pytest.approx(0.117, abs=0.001)
    for obs in fit.observations:
        if obs.fitted:
            assert abs(obs.residual) < 0.10, obs
    # a sensitivity fit keeps the 12-client slowdown
    other = fit_kit(kappa=0.02)
    assert other.demand < fit.demand
    assert other.model.slowdown(12, other.demand) == pytest.approx(
        fit.model.slowdown(12, fit.demand), rel=1e-3
    )


def test_kit_steady_ratios_are_within_ten_percent_of_table_2() -> None:
    jobs = kit_mix(160)
    config = PolicySimConfig(gpus=2)
    base = compute_metrics(simulate(jobs, named_policy("exclusive"), config))
    mps = compute_metrics(simulate(jobs, named_policy("mps"), config))
    ratio = mps.steady_throughput_per_h / base.steady_throughput_per_h
    assert ratio == pytest.approx(18.16 / 1.94, rel=0.10)


def test_hybrid_shares_inside_instances_and_never_mixes_users() -> None:
    jobs = [replace(j, uid=1000 + i % 3) for i, j in enumerate(workload("ht3"))]
    result = simulate(jobs, named_policy("hybrid"), PolicySimConfig(check_invariants=True))
    metrics = compute_metrics(result)
    assert metrics.complete and metrics.isolation_breaches == 0
    assert any(p.startswith("mps@") for r in result.records for p in r.profiles)


def test_a_multi_user_server_is_counted_as_a_breach() -> None:
    jobs = [
        WorkloadJob(f"j{i}", 0.0, 2000, runtime_s=100.0, compute_demand=0.1, uid=1000 + i % 2)
        for i in range(4)
    ]
    spec = named_policy("mps")
    spec = replace(spec, scheduler=replace(spec.scheduler, mps_multi_user=True))
    assert simulate(jobs, spec, PolicySimConfig()).isolation_breaches > 0
    assert simulate(jobs, named_policy("mps"), PolicySimConfig()).isolation_breaches == 0


def test_area_bounds_hold_for_every_policy() -> None:
    jobs = workload("ht1")
    bounds = area_bounds(jobs, geometry("A100-40GB"), 1, 1024)
    for name in ("migd", "mps", "hybrid"):
        m = compute_metrics(simulate(jobs, named_policy(name), PolicySimConfig()))
        assert m.throughput_per_h <= max(bounds.mig_per_h, bounds.shared_per_h) * 1.0001
    migd = compute_metrics(simulate(jobs, named_policy("migd"), PolicySimConfig()))
    assert migd.throughput_per_h <= bounds.mig_per_h * 1.0001


def test_pool_stream_is_a_day_at_the_offered_load() -> None:
    jobs = pool_stream(2, 8, hours=24.0, load=0.5)
    assert len(jobs) == 12 * 16
    assert max(j.submit_s for j in jobs) <= 24 * 3600
    assert {j.kind for j in jobs} >= {"tf", "small", "full"}
    assert len({j.uid for j in jobs}) > 1


def test_a_hybrid_pool_matches_jobs_to_their_users_servers() -> None:
    jobs = pool_stream(3, 2, hours=6.0, jobs_per_gpu_day=40)
    config = PolicySimConfig(gpus=2, nodes=3, check_invariants=True)
    result = simulate(jobs, named_policy("hybrid"), config)
    metrics = compute_metrics(result)
    assert metrics.complete and metrics.isolation_breaches == 0
    assert any(p.startswith("mps@") for r in result.records for p in r.profiles)
