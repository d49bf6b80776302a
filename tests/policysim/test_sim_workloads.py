"""Workload generators and trace loading."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from migd.core.catalog import geometry
from migd.core.planner import right_size
from migd.errors import ConfigError, InvalidRequest, UnknownModel
from migd.policysim.jobs import Growth, WorkloadJob, runtime_at
from migd.policysim.workloads import (
    ALIBABA_PROFILE_MIX,
    WORKLOADS,
    alibaba_mix,
    far_jobs,
    far_tasks,
    llm_mix,
    load_trace,
    seed002_mix,
    workload,
)

A100 = geometry("A100-40GB")
CLASSIC = A100.profile_set("classic")
BUCKET_PROFILE = {"small": "1g.5gb", "medium": "2g.10gb", "large": "3g.20gb", "full": "7g.40gb"}


@pytest.mark.parametrize(
    ("name", "counts"),
    [
        ("hm1", {"small": 50}),
        ("hm3", {"small": 100}),
        ("hm4", {"large": 50}),
        ("ht1", {"small": 11, "medium": 2, "large": 2}),
        ("ht2", {"small": 6, "large": 6, "full": 6}),  # 1:0:1:1 of 18
        ("ht3", {"small": 24, "large": 6, "full": 6}),  # 4:0:1:1 of 36
    ],
)
def test_seed002_mixes_have_the_papers_composition(name: str, counts: dict[str, int]) -> None:
    jobs = seed002_mix(name)
    found: dict[str, int] = {}
    for job in jobs:
        found[job.kind] = found.get(job.kind, 0) + 1
        # every job right-sizes to its bucket's profile (5/10/20/40 GB)
        prof = right_size(CLASSIC, job.memory_mib)
        assert prof is not None and prof.name == BUCKET_PROFILE[job.kind]
    assert found == counts


def test_ht1_groups_have_equal_total_runtime() -> None:
    totals: dict[str, float] = {}
    for job in seed002_mix("ht1"):
        totals[job.kind] = totals.get(job.kind, 0.0) + job.runtime_s
    assert len({round(v) for v in totals.values()}) == 1


def test_generators_are_deterministic() -> None:
    for name in WORKLOADS:
        if name == "kit":
            continue
        assert workload(name, 5) == workload(name, 5)
    assert seed002_mix("ht2", 1) != seed002_mix("ht2", 2)


def test_alibaba_mix_offers_the_requested_load() -> None:
    jobs = alibaba_mix(3000, seed=2, gpus=8, load=1.0)
    span = jobs[-1].submit_s - jobs[0].submit_s
    slices = sum(j.min_compute * j.runtime_s for j in jobs)
    offered = slices / span / (8 * 7)
    assert 0.85 < offered < 1.15
    assert all(j.wait_s == 0 for j in jobs)
    names = {right_size(CLASSIC, j.memory_mib, j.min_compute).name for j in jobs}  # type: ignore[union-attr]
    assert names == {"1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"}


@pytest.mark.parametrize("scaling", ["poor", "mixed", "good"])
def test_far_tasks_follow_seed003_generator(scaling: str) -> None:
    tasks = far_tasks(20, scaling, "wide", seed=3)
    assert len(tasks) == 20
    for task in tasks:
        sizes = sorted(task.times)
        assert sizes == [1, 2, 3, 4, 7]
        # monotony property 1: more slices never slower
        for a, b in itertools.pairwise(sizes):
            assert task.times[b] <= task.times[a] + 1e-9
        assert 1.0 <= task.times[1] <= 100.0
    if scaling == "poor":
        # nothing scales well beyond 2 slices: t(7) stays above half of t(2)
        assert all(t.times[7] > 0.45 * t.times[2] for t in tasks)


def test_far_jobs_ask_for_the_fastest_area_size() -> None:
    tasks = far_tasks(10, "mixed", "narrow", seed=1)
    for task, job in zip(tasks, far_jobs(tasks), strict=True):
        prof = right_size(CLASSIC, job.memory_mib, job.min_compute)
        assert prof is not None and prof.compute_slices == task.best_size
        assert runtime_at(job, task.best_size / 7, 7) == pytest.approx(task.times[task.best_size])


def test_llm_jobs_oom_where_seed002_says() -> None:
    by_kind = {j.kind: j for j in llm_mix(1, noise_frac=0.0)}
    qwen = by_kind["qwen2"].growth
    assert qwen is not None and qwen.first_over(9984) == 94  # 10 GB partition, iteration 94
    llama = by_kind["llama3"].growth
    assert llama is not None and llama.first_over(9984) == 72
    assert by_kind["flan-t5-train"].growth.first_over(4864) == 41  # type: ignore[union-attr]
    assert by_kind["flan-t5"].growth.first_over(4864) == 27  # type: ignore[union-attr]


def test_llm_jobs_declare_a_horizon_only_when_told() -> None:
    # the daemon's default: a job that sets no MigdHorizon gives the forecast none
    assert all(j.horizon is None for j in llm_mix(1))
    assert all(j.horizon is None for j in workload("llm", 1))
    every = workload("llm-horizon", 1)
    assert all(j.growth is not None and j.horizon == j.growth.iterations for j in every)
    half = llm_mix(1, horizon_share=0.5)
    assert sum(j.horizon is not None for j in half) == 6
    # the same jobs otherwise
    assert [replace(j, horizon=None) for j in half] == llm_mix(1)
    with pytest.raises(InvalidRequest, match="horizon_share"):
        llm_mix(1, horizon_share=1.5)


@pytest.mark.parametrize("model", ["A30-24GB", "H100-80GB"])
def test_workloads_are_rebuilt_for_the_model(model: str) -> None:
    geo = geometry(model)
    classic = geo.profile_set("classic")
    for name in ("ht3", "alibaba", "far-mixed-wide"):
        jobs = WORKLOADS[name].build(1, model)
        assert jobs != WORKLOADS[name].build(1)
        assert all(right_size(classic, j.memory_mib, j.min_compute) is not None for j in jobs)
    # ht3's full jobs use the model's whole-GPU profile (less its MPS reserve)
    full = [j for j in WORKLOADS["ht3"].build(1, model) if j.kind == "full"]
    biggest = max(p.memory_mib for p in classic)
    assert max(j.memory_mib for j in full) > biggest // 2
    assert max(j.memory_mib for j in full) <= biggest - 2048
    # the [Siavashi]-shaped mix asks for the model's own profiles
    kinds = {j.kind for j in WORKLOADS["alibaba"].build(1, model)}
    assert kinds == {p.name for p in classic if p.name.split(".")[0] in ALIBABA_PROFILE_MIX}
    # jobs defined in absolute memory are the same on every model
    assert WORKLOADS["kit"].build(1, model) == WORKLOADS["kit"].build(1)
    with pytest.raises(UnknownModel):
        WORKLOADS["ht3"].build(1, "Z9000")


def test_growth_validation() -> None:
    with pytest.raises(InvalidRequest):
        Growth(1000, 500, 10)
    with pytest.raises(InvalidRequest):
        Growth(1000, 2000, 1)
    with pytest.raises(InvalidRequest, match="compute_demand"):
        WorkloadJob("x", 0.0, 100, 10.0, compute_demand=1.5)


def test_load_csv_trace(tmp_path: Path) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(
        "job_id,submit_s,memory_mib,runtime_s,compute_demand,peak_mib,iterations,wait_s\n"
        "b,10,9000,60,0.5,,,\n"
        "a,0,4000,30,,8000,50,0\n"
    )
    jobs = load_trace(path)
    assert [j.job_id for j in jobs] == ["a", "b"]  # submission order
    a, b = jobs
    assert a.growth is not None and a.growth.peak_mib == 8000 and a.growth.iterations == 50
    assert a.wait_s == 0.0 and b.wait_s is None
    assert b.compute_demand == 0.5 and a.compute_demand == 1.0
    assert a.horizon is None


def test_trace_jobs_may_declare_a_horizon(tmp_path: Path) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(
        "submit_s,memory_mib,runtime_s,peak_mib,iterations,horizon\n"
        "0,4000,30,8000,50,50\n"
        "1,4000,30,8000,50,\n"
    )
    declared, silent = load_trace(path)
    assert declared.horizon == 50.0 and silent.horizon is None
    path.write_text("submit_s,memory_mib,runtime_s,horizon\n0,4000,30,-3\n")
    with pytest.raises(ConfigError, match="horizon"):
        load_trace(path)


def test_load_json_trace(tmp_path: Path) -> None:
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps({"jobs": [{"submit_s": 0, "memory_mib": 100, "runtime_s": 5}]}))
    (job,) = load_trace(path)
    assert job.job_id == "job-00000" and job.memory_mib == 100


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("submit_s,memory_mib\n0,100\n", "missing required column 'runtime_s'"),
        ("submit_s,memory_mib,runtime_s\n0,lots,5\n", "not a number"),
        ("submit_s,memory_mib,runtime_s\n0,100,-5\n", "runtime_s must be positive"),
        ("submit_s,memory_mib,runtime_s\n", "no jobs"),
        ("[1, 2]", "each job must be an object"),
    ],
)
def test_bad_traces_say_where(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        load_trace(path)
    assert str(path) in info.value.where


def test_missing_trace_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read trace"):
        load_trace(tmp_path / "nope.csv")
