"""Restart sizing (migd.core.restart): one rule for the wrapper and the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migd.core.catalog import geometry
from migd.core.restart import restart_size
from migd.errors import InvalidRequest

A100 = [p.memory_mib for p in geometry("A100-40GB").profiles]  # 4864 ... 40448
LARGEST = max(A100)


def test_mig_oom_asks_for_the_next_size_up() -> None:
    size = restart_size(4864, ladder=True, largest_mib=LARGEST)
    assert (size.request_mib, size.wanted_mib, size.capped) == (4865, 4865, False)
    on_ladder = restart_size(4864, ladder=True, largest_mib=LARGEST, sizes=A100)
    assert on_ladder.request_mib == 9984  # the next profile's memory


def test_without_a_ladder_it_doubles_and_a_growth_factor_wins_everywhere() -> None:
    assert restart_size(3000, ladder=False, largest_mib=39424).request_mib == 6000
    assert (
        restart_size(3000, ladder=False, largest_mib=39424, growth_factor=1.5).request_mib == 4500
    )
    assert (
        restart_size(4864, ladder=True, largest_mib=LARGEST, growth_factor=3).request_mib == 14592
    )


def test_evidence_raises_the_request() -> None:
    # peak 4800 + a failed 2 GiB allocation on 1g.5gb: 6848 MiB, rounded up to 1g.10gb
    size = restart_size(4864, ladder=True, largest_mib=LARGEST, needed_mib=4800 + 2048, sizes=A100)
    assert size.request_mib == 9984
    size = restart_size(4864, ladder=True, largest_mib=LARGEST, needed_mib=12000, sizes=A100)
    assert size.request_mib == 20091  # 3g.20gb
    assert "evidence" in size.reason


def test_more_than_the_node_holds_tries_the_largest_first() -> None:
    # An MPS share of 30 GiB doubles to 60 GiB; the node's largest share is 39 GiB.
    size = restart_size(30720, ladder=False, largest_mib=39424)
    assert (size.request_mib, size.wanted_mib, size.capped) == (39424, 61440, True)
    assert "largest partition here" in size.reason
    # A forecast of 50 GiB for a job on 3g.20gb: try 7g.40gb rather than give up.
    size = restart_size(19968, ladder=True, largest_mib=LARGEST, needed_mib=51200, sizes=A100)
    assert (size.request_mib, size.wanted_mib, size.capped) == (LARGEST, 51200, True)


def test_nothing_bigger_on_the_node_means_no_request_but_a_wanted_size() -> None:
    size = restart_size(LARGEST, ladder=True, largest_mib=LARGEST, sizes=A100)
    assert size.request_mib is None and size.wanted_mib == LARGEST + 1
    assert "nothing bigger" in size.reason
    whole = restart_size(40960, ladder=False, largest_mib=40960)
    assert whole.request_mib is None and whole.wanted_mib == 81920


def test_unknown_node_size_is_not_capped() -> None:
    size = restart_size(30720, ladder=False, largest_mib=None)
    assert (size.request_mib, size.capped) == (61440, False)


@pytest.mark.parametrize("kwargs", [{"limit_mib": 0}, {"limit_mib": 100, "growth_factor": -1.0}])
def test_bad_input_is_refused(kwargs: dict[str, float]) -> None:
    limit = int(kwargs.pop("limit_mib"))
    with pytest.raises(InvalidRequest):
        restart_size(limit, ladder=True, largest_mib=None, **kwargs)  # type: ignore[arg-type]


@given(
    limit=st.integers(1, 200_000),
    ladder=st.booleans(),
    largest=st.none() | st.integers(1, 200_000),
    needed=st.none() | st.floats(0, 400_000),
    growth=st.sampled_from([0.0, 1.0, 1.5, 2.0, 4.0]),
)
def test_properties(
    limit: int, ladder: bool, largest: int | None, needed: float | None, growth: float
) -> None:
    size = restart_size(limit, ladder=ladder, largest_mib=largest, needed_mib=needed,
                        growth_factor=growth)  # fmt: skip
    assert size.wanted_mib > limit  # always strictly bigger
    if needed is not None:
        assert size.wanted_mib >= needed
    if size.request_mib is None:
        assert largest is not None and largest <= limit  # only when nothing bigger exists
    else:
        assert limit < size.request_mib <= size.wanted_mib
        assert largest is None or size.request_mib <= largest
        assert size.capped == (size.request_mib < size.wanted_mib)


# -- the simulator restarts jobs by the same rule -------------------------------------------


def test_simulator_restarts_an_mps_job_as_the_wrapper_would() -> None:
    from migd.policysim.engine import PolicySimConfig, simulate
    from migd.policysim.jobs import Growth, WorkloadJob
    from migd.policysim.policies import named_policy

    # 10000 -> 25000 MiB: the wrapper doubles an MPS share (20000, still too small),
    # then asks for 40000 and gets the node's largest share.
    job = WorkloadJob("g", 0.0, 10000, 100.0, compute_demand=0.5, growth=Growth(10000, 25000, 10))
    record = simulate([job], named_policy("mps"), PolicySimConfig()).records[0]
    assert record.outcome == "completed", record.reason
    assert record.oom_kills == 2


def test_simulator_gives_up_only_when_nothing_bigger_exists() -> None:
    from migd.policysim.engine import PolicySimConfig, simulate
    from migd.policysim.jobs import Growth, WorkloadJob
    from migd.policysim.policies import named_policy

    job = WorkloadJob("huge", 0.0, 30000, 100.0, growth=Growth(30000, 45000, 10))
    record = simulate([job], named_policy("migd"), PolicySimConfig()).records[0]
    assert record.profiles == ["7g.40gb"] and record.outcome == "failed"
    assert "largest" in record.reason
