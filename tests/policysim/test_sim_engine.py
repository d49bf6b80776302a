"""The simulator drives the real scheduler: hand-checkable scenarios and invariants."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migd.core.catalog import geometry
from migd.core.costs import CostModel
from migd.core.forecast import Forecaster, Verdict
from migd.core.gpus import GpuMode, Work
from migd.core.queueing import QueuePolicy
from migd.core.scheduler import NodeScheduler, Outcome
from migd.errors import InvalidRequest
from migd.policysim.engine import PolicySimConfig, PolicySimResult, Simulation, simulate
from migd.policysim.jobs import Growth, WorkloadJob, runtime_at
from migd.policysim.metrics import compute_metrics
from migd.policysim.policies import POLICY_NAMES, PolicySpec, named_policy, static_policies

A100 = geometry("A100-40GB")
TABLE1 = CostModel.for_model("A100-40GB")


def small(
    i: int, runtime_s: float = 100.0, demand: float = 0.1, submit_s: float = 0.0
) -> WorkloadJob:
    return WorkloadJob(f"s{i}", submit_s, 4000, runtime_s, compute_demand=demand, kind="small")


def job_spans(result: PolicySimResult) -> list:  # type: ignore[type-arg]
    return [s for s in result.spans if s.kind == "job"]


def test_seven_small_jobs_finish_in_one_wave() -> None:
    # 7 x 1g.5gb fill an A100; creations are serialised (0.16 s each, [Villarrubia] Table 1),
    # then every job runs 100 s (its demand 0.1 fits in 1/7 of the GPU).
    result = simulate([small(i) for i in range(7)], named_policy("migd"), PolicySimConfig())
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
    result = simulate([small(i) for i in range(8)], named_policy("migd"), PolicySimConfig())
    last = max(result.records, key=lambda r: r.first_start_s or 0)
    first_end = min(r.end_s or math.inf for r in result.records)
    # it reuses the freed 1g.5gb instance: no new creation, starts as the first job ends
    assert last.first_start_s == pytest.approx(first_end)
    assert compute_metrics(result).creates == 7


def test_exclusive_runs_one_job_per_gpu_at_a_time() -> None:
    jobs = [small(i, runtime_s=50.0 + i) for i in range(5)]
    result = simulate(jobs, named_policy("exclusive", QueuePolicy.FIFO), PolicySimConfig())
    spans = sorted(job_spans(result), key=lambda s: s.start_s)
    for a, b in itertools.pairwise(spans):
        assert b.start_s >= a.end_s - 1e-9
    assert compute_metrics(result).makespan_s == pytest.approx(sum(j.runtime_s for j in jobs))


def test_exclusive_pool_uses_both_nodes() -> None:
    jobs = [small(0), small(1)]
    result = simulate(jobs, named_policy("exclusive"), PolicySimConfig(nodes=2))
    assert {s.node for s in job_spans(result)} == {0, 1}
    assert compute_metrics(result).makespan_s == pytest.approx(100.0)


def test_mps_processor_sharing() -> None:
    # two clients of demand 0.6 share one GPU: together 1.2, so each runs 1.2x slower
    jobs = [WorkloadJob(f"m{i}", 0.0, 8000, 100.0, compute_demand=0.6) for i in range(2)]
    result = simulate(jobs, named_policy("mps"), PolicySimConfig())
    assert [r.end_s for r in result.records] == pytest.approx([120.0, 120.0])
    m = compute_metrics(result)
    assert m.compute_util == pytest.approx(1.0)


def test_mps_refuses_more_than_its_memory() -> None:
    # 39 GiB usable (1 GiB reserve): two 25 GB jobs cannot share, they run one after another
    jobs = [WorkloadJob(f"m{i}", 0.0, 25000, 100.0, compute_demand=0.3) for i in range(2)]
    result = simulate(jobs, named_policy("mps"), PolicySimConfig(check_invariants=True))
    ends = sorted(r.end_s or 0 for r in result.records)
    assert ends == pytest.approx([100.0, 200.0])


def test_static_layout_refuses_what_no_instance_holds() -> None:
    seven_small = next(
        p
        for p in static_policies(A100)
        if "1g.5gb@6" in p.description and "2g" not in p.description and "3g" not in p.description
    )
    jobs = [small(0), WorkloadJob("big", 0.0, 15000, 50.0)]
    result = simulate(jobs, seven_small, PolicySimConfig())
    outcome = {r.job.job_id: r.outcome for r in result.records}
    assert outcome == {"s0": "completed", "big": "rejected"}
    assert compute_metrics(result).creates == 0


def test_static_layout_offers_the_smallest_idle_instance_that_fits() -> None:
    layout = next(
        p
        for p in static_policies(A100)
        if "2g.10gb" in p.description and "3g" not in p.description and "4g" not in p.description
    )
    result = simulate([small(0)], layout, PolicySimConfig())
    assert result.records[0].profiles == ["1g.5gb"]


def test_static_scheme_b_is_fifo_and_a_backfills() -> None:
    # 4g.20gb + three 1g.5gb. Two 15 GB jobs need the 4g; a small job arriving behind
    # the second one passes it under A (backfill) but waits its turn under B (FIFO),
    # as migd's own scheme B does.
    layout = next(
        p
        for p in static_policies(A100)
        if "4g.20gb" in p.description and p.description.count("1g.5gb") == 3
    )
    jobs = [
        WorkloadJob("big1", 0.0, 15000, 100.0),
        WorkloadJob("big2", 0.5, 15000, 100.0),
        WorkloadJob("small", 1.0, 4000, 10.0),
    ]
    starts = {}
    for queue in (QueuePolicy.SIZE, QueuePolicy.FIFO):
        spec = layout.with_queue(queue)
        records = simulate(jobs, spec, PolicySimConfig(check_invariants=True)).records
        starts[queue] = {r.job.job_id: r.first_start_s for r in records}
    big1_end = runtime_at(jobs[0], 4 / 7, 7)  # 175 s on the 4g
    assert starts[QueuePolicy.SIZE]["small"] == pytest.approx(1.0)
    assert starts[QueuePolicy.FIFO]["big2"] == pytest.approx(big1_end)
    assert starts[QueuePolicy.FIFO]["small"] == pytest.approx(big1_end)


def test_pool_refuses_what_no_node_can_ever_hold_by_the_schedulers_own_check() -> None:
    # MPS keeps a reserve: a job that fits the GPU's memory but not the MPS pool is
    # refused at the matcher, for the reason submit() itself would give
    cap = named_policy("mps").scheduler.mps_reserve_mib
    jobs = [
        WorkloadJob("fits", 0.0, 4000, 10.0),
        WorkloadJob("over", 0.0, A100.memory_mib - cap + 1, 10.0),
    ]
    result = simulate(jobs, named_policy("mps"), PolicySimConfig(nodes=2, check_invariants=True))
    outcome = {r.job.job_id: (r.outcome, r.reason) for r in result.records}
    assert outcome["fits"][0] == "completed"
    assert outcome["over"] == ("rejected", "no partition on any node can ever hold it")
    direct = simulate([jobs[1]], named_policy("mps"), PolicySimConfig()).records[0]
    assert direct.outcome == "rejected" and "can ever hold the request: 39425 MiB" in direct.reason


def test_the_queue_is_scheduled_after_every_finished_work_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # work_done's outcome has the scheduling pass it makes possible; the simulator acts on
    # it as the daemon does (lease_service.LeaseService.apply)
    calls: list[str] = []
    real_done, real_schedule = NodeScheduler.work_done, NodeScheduler._schedule

    def done(self: NodeScheduler, *args: object) -> Outcome:
        calls.append("work_done")
        return real_done(self, *args)  # type: ignore[arg-type]

    def schedule(self: NodeScheduler, *args: object) -> list[Work]:
        calls.append("schedule")
        return real_schedule(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(NodeScheduler, "work_done", done)
    monkeypatch.setattr(NodeScheduler, "_schedule", schedule)
    simulate([small(i) for i in range(9)], named_policy("migd"), PolicySimConfig())
    assert calls.count("work_done") >= 7
    for i, call in enumerate(calls):
        if call == "work_done":
            assert calls[i + 1] == "schedule"


def test_ended_leases_leave_the_scheduler() -> None:
    # as the daemon does once they are persisted: memory does not grow with history
    sim = Simulation([small(i) for i in range(12)], named_policy("migd"), PolicySimConfig())
    seen: list[int] = []
    real = sim._settle

    def settle() -> None:
        real()
        seen.append(len(sim.nodes[0].scheduler.leases))

    sim._settle = settle  # type: ignore[method-assign]
    result = sim.run()
    assert all(r.outcome == "completed" for r in result.records)
    assert max(seen) <= 12 and seen[-1] == 0
    assert sim.nodes[0].scheduler.leases == {}


def test_seed001_first_fit_takes_the_lowest_start_and_the_first_node() -> None:
    # the driver's own order puts a lone 1g.5gb at start 6; [Siavashi]'s sequential FF at 0
    driver = simulate([small(0)], named_policy("first-fit"), PolicySimConfig())
    seq = simulate([small(0)], named_policy("first-fit-seq"), PolicySimConfig())
    assert [s.unit_start for s in job_spans(driver)] == [6]
    assert [s.unit_start for s in job_spans(seq)] == [0]
    assert A100.by_id(19).default_order[0] == 6  # the catalog is left alone
    # in a pool it fills node 0 before node 1; the best-fit matcher packs the
    # partly used node too, but offers a whole-GPU job the emptier one
    jobs = [WorkloadJob("a", 0.0, 4000, 100.0), WorkloadJob("b", 1.0, 4000, 100.0)]
    pool = PolicySimConfig(nodes=2, check_invariants=True)
    assert {s.node for s in job_spans(simulate(jobs, named_policy("first-fit-seq"), pool))} == {0}


def test_refused_at_once_when_wait_is_zero() -> None:
    jobs = [WorkloadJob(f"v{i}", 0.0, 30000, 100.0, wait_s=0.0) for i in range(2)]
    result = simulate(jobs, named_policy("migd"), PolicySimConfig())
    assert sorted(r.outcome for r in result.records) == ["completed", "rejected"]
    assert compute_metrics(result).acceptance == pytest.approx(0.5)


def test_deadline_expires_a_queued_job() -> None:
    jobs = [WorkloadJob("a", 0.0, 30000, 100.0), WorkloadJob("b", 0.0, 30000, 10.0, wait_s=50.0)]
    result = simulate(jobs, named_policy("migd"), PolicySimConfig())
    outcome = {r.job.job_id: r.outcome for r in result.records}
    assert outcome == {"a": "completed", "b": "rejected"}


def growing(noise: float = 0.0) -> WorkloadJob:
    # 4000 -> 8000 MiB over 100 iterations: exceeds 1g.5gb (4864 MiB) in iteration 22
    return WorkloadJob(
        "llm",
        0.0,
        4000,
        700.0,
        compute_demand=1 / 7,
        growth=Growth(4000, 8000, 100, noise_mib=noise),
    )


def test_oom_kills_on_the_next_larger_profile() -> None:
    result = simulate([growing()], named_policy("migd"), PolicySimConfig())
    record = result.records[0]
    assert record.outcome == "completed"
    assert record.profiles == ["1g.5gb", "2g.10gb"]
    assert record.oom_kills == 1
    died_at = 23 / 100 * 700.0  # iteration 22 is the 23rd
    assert record.lost_wall_s == pytest.approx(died_at)
    assert record.lost_gpu_s == pytest.approx(died_at / 7)


def test_forecast_with_a_declared_horizon_kills_earlier_than_the_oom() -> None:
    job = replace(growing(noise=20.0), horizon=100.0)  # the job sets MigdHorizon = 100
    oom = simulate([job], named_policy("migd"), PolicySimConfig()).records[0]
    early = simulate([job], named_policy("migd+forecast"), PolicySimConfig()).records[0]
    assert early.outcome == "completed"
    assert early.forecast_kills == 1 and early.oom_kills == 0
    assert early.profiles == ["1g.5gb", "2g.10gb"]
    assert early.lost_gpu_s < oom.lost_gpu_s
    assert early.end_s is not None and oom.end_s is not None and early.end_s < oom.end_s


def test_forecast_without_a_horizon_looks_only_as_far_as_it_has_seen() -> None:
    # what the wrapper does for a job without MigdHorizon: the forecast still restarts
    # the job before its OOM, but later, and sized for a nearer peak: here 1g -> 2g is
    # not enough and it restarts again (4g), losing more than the OOM would have
    oom = simulate([growing(noise=20.0)], named_policy("migd"), PolicySimConfig()).records[0]
    early = simulate(
        [growing(noise=20.0)], named_policy("migd+forecast"), PolicySimConfig()
    ).records[0]
    assert early.outcome == "completed" and early.oom_kills == 0
    assert early.forecast_kills == 2
    assert early.profiles == ["1g.5gb", "2g.10gb", "4g.20gb"]
    assert early.lost_gpu_s > oom.lost_gpu_s


def test_the_forecaster_gets_the_jobs_declared_horizon(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[float | None] = []
    real = Forecaster.verdict

    def spy(self: Forecaster, limit_mib: float, horizon: float | None = None) -> Verdict:
        seen.append(horizon)
        return real(self, limit_mib, horizon)

    monkeypatch.setattr(Forecaster, "verdict", spy)
    simulate([growing()], named_policy("migd+forecast"), PolicySimConfig())
    assert seen and set(seen) == {None}
    seen.clear()
    simulate([replace(growing(), horizon=99.0)], named_policy("migd+forecast"), PolicySimConfig())
    assert seen and set(seen) == {99.0}


def test_oom_on_the_whole_gpu_fails_the_job() -> None:
    job = WorkloadJob("huge", 0.0, 30000, 100.0, growth=Growth(30000, 45000, 10))
    record = simulate([job], named_policy("exclusive"), PolicySimConfig()).records[0]
    assert record.outcome == "failed"
    assert "largest" in record.reason


def test_reconfiguration_accounting_adds_up() -> None:
    jobs = [
        WorkloadJob(
            f"j{i}", 40.0 * i, [4000, 9000, 18000, 30000][i % 4], 60.0 + 13 * i, compute_demand=0.3
        )
        for i in range(16)
    ]
    result = simulate(jobs, named_policy("migd", QueuePolicy.FIFO), PolicySimConfig(gpus=2))
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
        WorkloadJob(f"j{i}", 0.0, [4000, 9000, 18000][i % 3], 100.0, compute_demand=0.5)
        for i in range(9)
    ]
    result = simulate(jobs, named_policy("migd"), PolicySimConfig())
    by_id = {j.job_id: j for j in jobs}
    profiles = {p.name: p for p in A100.profiles}
    spans = job_spans(result)
    assert len(spans) == len(jobs)
    for span in spans:
        share = profiles[span.partition].compute_slices / 7
        expected = runtime_at(by_id[span.job], share, 7)
        assert span.end_s - span.start_s == pytest.approx(expected)


def test_same_seed_same_result() -> None:
    from migd.policysim.workloads import workload

    a = compute_metrics(simulate(workload("ht2", 3), named_policy("migd"), PolicySimConfig()))
    b = compute_metrics(simulate(workload("ht2", 3), named_policy("migd"), PolicySimConfig()))
    assert a == b


def test_a_refused_request_does_not_lose_the_work_it_started_for_others() -> None:
    # FIFO: j4 (too big for now) blocks j3 until j4's deadline at 306 s; nothing re-runs
    # the queue then (nor in the daemon). At 307 s j0 (wait_s=0) arrives: its submit()
    # schedules j3, then refuses j0 and the work creating j3's instance is lost.
    def job(
        name: str, submit_s: float, memory: int, runtime: float, wait: float | None
    ) -> WorkloadJob:
        return WorkloadJob(name, submit_s, memory, runtime, compute_demand=0.05, wait_s=wait)

    jobs = [
        job("j0", 307.0, 15000, 5.0, 0.0),
        job("j1", 0.0, 1500, 5.0, None),
        job("j2", 0.0, 1500, 5.0, None),
        job("j3", 187.0, 1500, 5.0, None),
        job("j4", 186.0, 30000, 5.0, 120.0),
        job("j5", 0.0, 9000, 307.0, None),
    ]
    result = simulate(jobs, named_policy("first-fit", QueuePolicy.FIFO), PolicySimConfig())
    outcome = {r.job.job_id: r.outcome for r in result.records}
    assert outcome["j3"] == "completed"


# -- invariants over random workloads and policies ---------------------------------------------


@st.composite
def workloads(draw: st.DrawFn) -> list[WorkloadJob]:
    n = draw(st.integers(1, 10))
    jobs = []
    for i in range(n):
        memory = draw(st.sampled_from([1500, 4000, 4864, 9000, 15000, 20091, 30000, 39000]))
        growth = None
        if draw(st.integers(0, 4)) == 0:
            peak = draw(st.integers(memory, memory + 12000))
            growth = Growth(memory, peak, draw(st.integers(2, 40)), noise_mib=50.0, seed=i)
        jobs.append(
            WorkloadJob(
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
    jobs: list[WorkloadJob], policy: PolicySpec, gpus: int, nodes: int
) -> None:
    # check_invariants asserts after every event: valid layouts, no overlapping or
    # over-committed instances, one job per exclusive GPU, MPS memory within capacity
    result = simulate(jobs, policy, PolicySimConfig(gpus=gpus, nodes=nodes, check_invariants=True))
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


# -- the pool matcher against the real HTCondor pool (docs/simulator.md) --------------------


def _whole_gpu_wave(ad_latency_s: float, c_uid: int = 2000) -> dict[str, float]:
    """Three whole-A100 jobs on two one-GPU nodes: the third (user ``c_uid``) waits in
    the matcher for the first (user 1000) to end. Returns (job id -> first start) and
    the first job's end."""
    jobs = [
        WorkloadJob("a", 0.0, 40000, 100.0, compute_demand=1.0, kind="full", uid=1000),
        WorkloadJob("b", 0.0, 40000, 200.0, compute_demand=1.0, kind="full", uid=1000),
        WorkloadJob("c", 10.0, 40000, 50.0, compute_demand=1.0, kind="full", uid=c_uid),
    ]
    config = PolicySimConfig(nodes=2, ad_latency_s=ad_latency_s, check_invariants=True)
    result = simulate(jobs, named_policy("migd"), config)
    out = {r.job.job_id: r.first_start_s or math.nan for r in result.records}
    [a] = [r for r in result.records if r.job.job_id == "a"]
    assert all(r.outcome == "completed" for r in result.records)
    return {**out, "a_end": a.end_s or math.nan}


def test_pool_sees_a_freed_node_only_after_the_ad_latency() -> None:
    instant = _whole_gpu_wave(0.0)
    late = _whole_gpu_wave(1.4)
    # placing a job shrinks the node's ad at once: a and b start together on two nodes
    assert late["a"] == instant["a"] and late["b"] == instant["b"]
    # the freed A100 reaches the matcher 1.4 s after a ends (the pool measured 0.8-1.9 s);
    # the idle 7g.40gb instance is reused, so nothing else separates c's start from a's end
    assert instant["c"] == pytest.approx(instant["a_end"])
    assert late["c"] == pytest.approx(late["a_end"] + 1.4)


def test_the_same_users_next_job_reuses_the_claim_without_waiting_for_the_ad() -> None:
    # the schedd reuses the claimed dynamic slot of a's user for that user's next job
    # that fits it, before any ad (the pool's whole-GPU wave: 0.2-0.8 s)
    late = _whole_gpu_wave(1.4, c_uid=1000)
    assert late["c"] == pytest.approx(late["a_end"])

    # a bigger job of the same user does not fit the slot: it waits for the ad, as
    # another user's job does
    def half_then_full(c_uid: int) -> float:
        jobs = [
            WorkloadJob("a", 0.0, 20000, 100.0, compute_demand=0.5, kind="half", uid=1000),
            WorkloadJob("b", 0.0, 40000, 200.0, compute_demand=1.0, kind="full", uid=1000),
            WorkloadJob("c", 10.0, 40000, 50.0, compute_demand=1.0, kind="full", uid=c_uid),
        ]
        config = PolicySimConfig(nodes=2, ad_latency_s=1.4, check_invariants=True)
        records = {r.job.job_id: r for r in simulate(jobs, named_policy("migd"), config).records}
        start, a_end = records["c"].first_start_s, records["a"].end_s
        assert start is not None and a_end is not None
        assert a_end + 1.4 <= start < 200.0  # on a's node, after the ad, before b ends
        return start

    assert half_then_full(1000) == pytest.approx(half_then_full(2000))


def test_default_ad_latency_is_the_pools_measured_median() -> None:
    assert PolicySimConfig().ad_latency_s == 1.4
    with pytest.raises(InvalidRequest):
        PolicySimConfig(ad_latency_s=-1.0)
