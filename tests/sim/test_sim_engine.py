"""The simulator drives the real scheduler: hand-checkable scenarios and invariants."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.core.catalog import geometry
from migd.core.costs import CostModel
from migd.core.queueing import QueuePolicy
from migd.core.scheduler import GpuMode
from migd.sim.engine import SimConfig, SimResult, simulate
from migd.sim.jobs import Growth, SimJob, runtime_at
from migd.sim.metrics import compute_metrics
from migd.sim.policies import POLICY_NAMES, PolicySpec, named_policy, static_policies

A100 = geometry("A100-40GB")
TABLE1 = CostModel.for_model("A100-40GB")


def small(i: int, runtime_s: float = 100.0, demand: float = 0.1, submit_s: float = 0.0) -> SimJob:
    return SimJob(f"s{i}", submit_s, 4000, runtime_s, compute_demand=demand, kind="small")


def job_spans(result: SimResult) -> list:  # type: ignore[type-arg]
    return [s for s in result.spans if s.kind == "job"]


def test_seven_small_jobs_finish_in_one_wave() -> None:
    # 7 x 1g.5gb fill an A100; creations are serialised (0.16 s each, seed 003 Table 1),
    # then every job runs 100 s (its demand 0.1 fits in 1/7 of the GPU).
    result = simulate([small(i) for i in range(7)], named_policy("migd"), SimConfig())
    m = compute_metrics(result)
    assert m.completed == 7
    assert m.creates == 7
    # the idle instances go only after the idle timeout (300 s), long after the jobs
    instances = [s for s in result.spans if s.kind == "instance"]
    first_end = min(r.end_s or math.inf for r in result.records)
    assert all(s.end_s >= first_end + 300.0 for s in instances)
    starts = sorted(r.first_start_s or 0 for r in result.records)
    assert starts == pytest.approx([0.16 * (i + 1) for i in range(7)])
    assert m.makespan_s == pytest.approx(100.0 + 7 * 0.16)
    profiles = {p for r in result.records for p in r.profiles}
    assert profiles == {"1g.5gb"}


def test_eighth_small_job_waits_for_the_first_to_finish() -> None:
    result = simulate([small(i) for i in range(8)], named_policy("migd"), SimConfig())
    last = max(result.records, key=lambda r: r.first_start_s or 0)
    first_end = min(r.end_s or math.inf for r in result.records)
    # it reuses the freed 1g.5gb instance: no new creation, starts as the first job ends
    assert last.first_start_s == pytest.approx(first_end)
    assert compute_metrics(result).creates == 7


def test_exclusive_runs_one_job_per_gpu_at_a_time() -> None:
    jobs = [small(i, runtime_s=50.0 + i) for i in range(5)]
    result = simulate(jobs, named_policy("exclusive", QueuePolicy.FIFO), SimConfig())
    spans = sorted(job_spans(result), key=lambda s: s.start_s)
    for a, b in itertools.pairwise(spans):
        assert b.start_s >= a.end_s - 1e-9
    assert compute_metrics(result).makespan_s == pytest.approx(sum(j.runtime_s for j in jobs))


def test_exclusive_pool_uses_both_nodes() -> None:
    jobs = [small(0), small(1)]
    result = simulate(jobs, named_policy("exclusive"), SimConfig(nodes=2))
    assert {s.node for s in job_spans(result)} == {0, 1}
    assert compute_metrics(result).makespan_s == pytest.approx(100.0)


def test_mps_processor_sharing() -> None:
    # two clients of demand 0.6 share one GPU: together 1.2, so each runs 1.2x slower
    jobs = [SimJob(f"m{i}", 0.0, 8000, 100.0, compute_demand=0.6) for i in range(2)]
    result = simulate(jobs, named_policy("mps"), SimConfig())
    assert [r.end_s for r in result.records] == pytest.approx([120.0, 120.0])
    m = compute_metrics(result)
    assert m.compute_util == pytest.approx(1.0)


def test_mps_refuses_more_than_its_memory() -> None:
    # 39 GiB usable (1 GiB reserve): two 25 GB jobs cannot share, they run one after another
    jobs = [SimJob(f"m{i}", 0.0, 25000, 100.0, compute_demand=0.3) for i in range(2)]
    result = simulate(jobs, named_policy("mps"), SimConfig(check_invariants=True))
    ends = sorted(r.end_s or 0 for r in result.records)
    assert ends == pytest.approx([100.0, 200.0])


def test_static_layout_refuses_what_no_instance_holds() -> None:
    seven_small = next(
        p
        for p in static_policies(A100)
        if "1g.5gb@6" in p.description and "2g" not in p.description and "3g" not in p.description
    )
    jobs = [small(0), SimJob("big", 0.0, 15000, 50.0)]
    result = simulate(jobs, seven_small, SimConfig())
    outcome = {r.job.job_id: r.outcome for r in result.records}
    assert outcome == {"s0": "completed", "big": "rejected"}
    assert compute_metrics(result).creates == 0


def test_static_layout_offers_the_smallest_idle_instance_that_fits() -> None:
    layout = next(
        p
        for p in static_policies(A100)
        if "2g.10gb" in p.description and "3g" not in p.description and "4g" not in p.description
    )
    result = simulate([small(0)], layout, SimConfig())
    assert result.records[0].profiles == ["1g.5gb"]


def test_refused_at_once_when_wait_is_zero() -> None:
    jobs = [SimJob(f"v{i}", 0.0, 30000, 100.0, wait_s=0.0) for i in range(2)]
    result = simulate(jobs, named_policy("migd"), SimConfig())
    assert sorted(r.outcome for r in result.records) == ["completed", "rejected"]
    assert compute_metrics(result).acceptance == pytest.approx(0.5)


def test_deadline_expires_a_queued_job() -> None:
    jobs = [SimJob("a", 0.0, 30000, 100.0), SimJob("b", 0.0, 30000, 10.0, wait_s=50.0)]
    result = simulate(jobs, named_policy("migd"), SimConfig())
    outcome = {r.job.job_id: r.outcome for r in result.records}
    assert outcome == {"a": "completed", "b": "rejected"}


def growing(noise: float = 0.0) -> SimJob:
    # 4000 -> 8000 MiB over 100 iterations: exceeds 1g.5gb (4864 MiB) in iteration 22
    return SimJob(
        "llm",
        0.0,
        4000,
        700.0,
        compute_demand=1 / 7,
        growth=Growth(4000, 8000, 100, noise_mib=noise),
    )


def test_oom_kills_on_the_next_larger_profile() -> None:
    result = simulate([growing()], named_policy("migd"), SimConfig())
    record = result.records[0]
    assert record.outcome == "completed"
    assert record.profiles == ["1g.5gb", "2g.10gb"]
    assert record.oom_kills == 1
    died_at = 23 / 100 * 700.0  # iteration 22 is the 23rd
    assert record.lost_wall_s == pytest.approx(died_at)
    assert record.lost_gpu_s == pytest.approx(died_at / 7)


def test_forecast_kills_earlier_than_the_oom() -> None:
    oom = simulate([growing(noise=20.0)], named_policy("migd"), SimConfig()).records[0]
    early = simulate([growing(noise=20.0)], named_policy("migd+forecast"), SimConfig()).records[0]
    assert early.outcome == "completed"
    assert early.forecast_kills == 1 and early.oom_kills == 0
    assert early.lost_gpu_s < oom.lost_gpu_s
    assert early.end_s is not None and oom.end_s is not None and early.end_s < oom.end_s


def test_oom_on_the_whole_gpu_fails_the_job() -> None:
    job = SimJob("huge", 0.0, 30000, 100.0, growth=Growth(30000, 45000, 10))
    record = simulate([job], named_policy("exclusive"), SimConfig()).records[0]
    assert record.outcome == "failed"
    assert "largest" in record.reason


def test_reconfiguration_accounting_adds_up() -> None:
    jobs = [
        SimJob(
            f"j{i}", 40.0 * i, [4000, 9000, 18000, 30000][i % 4], 60.0 + 13 * i, compute_demand=0.3
        )
        for i in range(16)
    ]
    result = simulate(jobs, named_policy("migd", QueuePolicy.FIFO), SimConfig(gpus=2))
    m = compute_metrics(result)
    instances = [s for s in result.spans if s.kind == "instance"]
    # every instance span is one creation; those that ended before the end were destroyed
    assert m.creates == len(instances)
    destroyed = [s for s in instances if s.label == "destroyed"]
    assert m.destroys == len(destroyed)
    profiles = {p.name: p for p in A100.profiles}
    expected = sum(TABLE1.create_s(profiles[s.what].compute_slices) for s in instances)
    expected += sum(TABLE1.destroy_s(profiles[s.what].compute_slices) for s in destroyed)
    assert m.reconfig_s == pytest.approx(expected)


def test_runs_take_the_modelled_time() -> None:
    jobs = [
        SimJob(f"j{i}", 0.0, [4000, 9000, 18000][i % 3], 100.0, compute_demand=0.5)
        for i in range(9)
    ]
    result = simulate(jobs, named_policy("migd"), SimConfig())
    by_id = {j.job_id: j for j in jobs}
    profiles = {p.name: p for p in A100.profiles}
    spans = job_spans(result)
    assert len(spans) == len(jobs)
    for span in spans:
        share = profiles[span.partition].compute_slices / 7
        expected = runtime_at(by_id[span.job], share, 7)
        assert span.end_s - span.start_s == pytest.approx(expected)


def test_same_seed_same_result() -> None:
    from migd.sim.workloads import workload

    a = compute_metrics(simulate(workload("ht2", 3), named_policy("migd"), SimConfig()))
    b = compute_metrics(simulate(workload("ht2", 3), named_policy("migd"), SimConfig()))
    assert a == b


# -- invariants over random workloads and policies ---------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> list[SimJob]:
    n = draw(st.integers(1, 10))
    jobs = []
    for i in range(n):
        memory = draw(st.sampled_from([1500, 4000, 4864, 9000, 15000, 20091, 30000, 39000]))
        growth = None
        if draw(st.integers(0, 4)) == 0:
            peak = draw(st.integers(memory, memory + 12000))
            growth = Growth(memory, peak, draw(st.integers(2, 40)), noise_mib=50.0, seed=i)
        jobs.append(
            SimJob(
                f"j{i}",
                float(draw(st.integers(0, 600))),
                memory,
                float(draw(st.integers(5, 400))),
                compute_demand=draw(st.sampled_from([0.05, 0.2, 0.5, 1.0])),
                growth=growth,
                uid=draw(st.sampled_from([1000, 1001])),
                wait_s=draw(st.sampled_from([None, None, 0.0, 120.0])),
            )
        )
    return jobs


def policies() -> st.SearchStrategy[PolicySpec]:
    named = [
        named_policy(n, q)
        for n in POLICY_NAMES
        if n != "static"
        for q in (QueuePolicy.SIZE, QueuePolicy.FIFO)
    ]
    statics = static_policies(A100)[::4]
    return st.sampled_from(named + statics)


@given(jobs=workloads(), policy=policies(), gpus=st.integers(1, 2), nodes=st.integers(1, 2))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_jobs_are_conserved_and_capacity_is_never_exceeded(
    jobs: list[SimJob], policy: PolicySpec, gpus: int, nodes: int
) -> None:
    # check_invariants asserts after every event: valid layouts, no overlapping or
    # over-committed instances, one job per exclusive GPU, MPS memory within capacity
    result = simulate(jobs, policy, SimConfig(gpus=gpus, nodes=nodes, check_invariants=True))
    assert len(result.records) == len(jobs)
    for record in result.records:
        assert record.outcome in ("completed", "rejected", "failed"), record
        assert (record.end_s is not None) == (record.outcome == "completed")
        if record.outcome == "completed":
            assert record.end_s is not None and record.end_s >= record.job.submit_s
    m = compute_metrics(result)
    assert m.completed + m.rejected + m.failed == len(jobs)
    assert 0.0 <= m.compute_util <= 1.0 + 1e-9
    # a job span per run: completed jobs ran once more than they restarted
    runs = [s for s in result.spans if s.kind == "job"]
    killed = sum(r.oom_kills + r.forecast_kills for r in result.records)
    assert len(runs) == m.completed + killed
    if policy.gpu_mode is GpuMode.EXCLUSIVE or policy.static_layout is not None:
        assert m.creates == 0
