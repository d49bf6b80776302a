"""Queue policies, the lease transition table, demand weights, units and the error tree."""

from __future__ import annotations

import pytest

from migd import errors
from migd.core.demand import DemandModel
from migd.core.leases import TRANSITIONS, IllegalLeaseTransition, LeaseEvent, LeaseState, next_state
from migd.core.queueing import QueuePolicy, RequestQueue
from migd.core.units import format_mib, parse_mib

# -- queue ------------------------------------------------------------------------------------


def fill(queue: RequestQueue[str], sizes: list[int]) -> None:
    for n, size in enumerate(sizes):
        queue.push(f"r{n}", f"r{n}", now_s=float(n), memory_mib=size, wait_s=None)


def test_fifo_blocks_behind_the_head() -> None:
    queue: RequestQueue[str] = RequestQueue(QueuePolicy.FIFO)
    fill(queue, [40000, 5000, 5000])
    result = queue.schedule(10.0, lambda item: item.memory_mib < 10000)
    assert result.placed == [] and result.blocked_by == "r0"
    assert len(queue) == 3


def test_size_order_backfills_small_requests() -> None:
    queue: RequestQueue[str] = RequestQueue(QueuePolicy.SIZE, aging_s=0)
    fill(queue, [40000, 20000, 5000, 10000])
    result = queue.schedule(10.0, lambda item: item.memory_mib <= 10000)
    assert result.placed == ["r2", "r3"]
    assert [i.ident for i in queue.order(10.0)] == ["r1", "r0"]


def test_size_order_ages_large_requests_forward() -> None:
    queue: RequestQueue[str] = RequestQueue(QueuePolicy.SIZE, aging_s=100)
    queue.push("big", "big", now_s=0.0, memory_mib=40000, wait_s=None)
    queue.push("small", "small", now_s=1000.0, memory_mib=5000, wait_s=None)
    assert [i.ident for i in queue.order(1000.0)] == ["big", "small"]
    assert [i.ident for i in queue.order(1.0)] == ["small", "big"]


def test_starving_request_stops_backfill() -> None:
    queue: RequestQueue[str] = RequestQueue(QueuePolicy.SIZE, aging_s=0, starvation_s=50)
    queue.push("big", "big", now_s=0.0, memory_mib=40000, wait_s=None)
    queue.push("huge", "huge", now_s=0.0, memory_mib=50000, wait_s=None)
    queue.push("mid", "mid", now_s=60.0, memory_mib=30000, wait_s=None)
    tried: list[str] = []

    def never(item: object) -> bool:
        tried.append(item.ident)  # type: ignore[attr-defined]
        return False

    # t=10: nobody has starved, so every blocked request is skipped (backfill)
    assert queue.schedule(10.0, never).blocked_by is None
    assert tried == ["mid", "big", "huge"]
    # t=100: 'big' (100 s) has starved: it goes first and nothing younger passes it,
    # not even the smaller 'mid'
    tried.clear()
    assert queue.schedule(100.0, never).blocked_by == "big"
    assert tried == ["big"]
    assert [i.ident for i in queue.order(100.0)] == ["big", "huge", "mid"]


@pytest.mark.parametrize("aging_s", [0.0, 600.0])
def test_small_requests_never_pass_a_starved_one(aging_s: float) -> None:
    """A stream of small requests under size order: once the big one has starved,
    nothing smaller takes capacity before it, whatever aging says."""
    queue: RequestQueue[str] = RequestQueue(QueuePolicy.SIZE, aging_s=aging_s, starvation_s=50)
    queue.push("big", "big", now_s=0.0, memory_mib=40000, wait_s=None)
    for n in range(4):
        queue.push(f"s{n}", f"s{n}", now_s=10.0 * n, memory_mib=5000, wait_s=None)
    free = [30000]  # room for small requests only

    def place(item: object) -> bool:
        need = item.memory_mib  # type: ignore[attr-defined]
        if need > free[0]:
            return False
        free[0] -= need
        return True

    before = queue.schedule(40.0, place)  # nobody starved yet: small ones backfill
    assert before.placed == ["s0", "s1", "s2", "s3"] and before.blocked_by is None
    queue.push("s4", "s4", now_s=45.0, memory_mib=5000, wait_s=None)
    free[0] = 35000  # some released, not enough for the big one
    held = queue.schedule(60.0, place)
    assert held.placed == [] and held.blocked_by == "big"  # s4 would fit, but waits
    free[0] = 40000
    after = queue.schedule(61.0, place)
    assert after.placed == ["big"] and "s4" in queue


def test_starvation_zero_is_arrival_order_without_backfill() -> None:
    queue: RequestQueue[str] = RequestQueue(QueuePolicy.SIZE, aging_s=0, starvation_s=0)
    fill(queue, [40000, 5000])
    result = queue.schedule(10.0, lambda item: item.memory_mib < 10000)
    assert result.placed == [] and result.blocked_by == "r0"


def test_deadlines_expire() -> None:
    queue: RequestQueue[str] = RequestQueue()
    queue.push("a", "a", now_s=0.0, memory_mib=1, wait_s=5)
    queue.push("b", "b", now_s=0.0, memory_mib=1, wait_s=None)
    assert [i.ident for i in queue.expired(4.9)] == []
    assert [i.ident for i in queue.expired(5.0)] == ["a"]
    assert "b" in queue and "a" not in queue


# -- leases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("state", list(LeaseState))
@pytest.mark.parametrize("event", list(LeaseEvent))
def test_lease_transition_matrix(state: LeaseState, event: LeaseEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert next_state(state, event) is TRANSITIONS[(state, event)]
        assert not state.terminal
    else:
        with pytest.raises(IllegalLeaseTransition) as err:
            next_state(state, event)
        assert state.value in err.value.message and event.value in err.value.message


def test_only_live_leases_hold_resources() -> None:
    holders = {s for s in LeaseState if s.holds_resources}
    assert holders == {LeaseState.PREPARING, LeaseState.ACTIVE}
    assert not any(s.terminal for s in holders)


# -- demand -----------------------------------------------------------------------------------


def test_demand_weights_follow_observations_and_decay() -> None:
    a100 = "A100-40GB"
    model = DemandModel(prior={(a100, 19): 1.0, (a100, 9): 1.0}, prior_strength=2, half_life_s=100)
    assert model.weights(0.0) == {a100: {19: 0.5, 9: 0.5}}
    for _ in range(8):
        model.observe(a100, 9, 0.0)
    assert model.weights(0.0)[a100][9] == pytest.approx(9 / 10)
    later = model.weights(1000.0)  # 10 half-lives: observations almost gone
    assert later[a100][9] == pytest.approx(0.5, abs=0.01)


def test_demand_is_kept_apart_per_model() -> None:
    """Profile ID 14 is 2g.10gb on an A100 but 1g.6gb on an A30: never one count."""
    model = DemandModel()
    model.observe("A100-40GB", 14, 0.0)
    model.observe("A30-24GB", 14, 0.0)
    model.observe("A30-24GB", 0, 0.0)
    assert model.weights(0.0) == {"A100-40GB": {14: 1.0}, "A30-24GB": {14: 0.5, 0: 0.5}}
    saved = model.snapshot()
    assert saved == {"A100-40GB:14": 1.0, "A30-24GB:14": 1.0, "A30-24GB:0": 1.0}
    back = DemandModel()
    back.load({**saved, "9": 5.0}, 0.0)  # a bare ID from an older version is dropped
    assert back.weights(0.0) == model.weights(0.0)


def test_demand_is_empty_without_prior_or_data() -> None:
    assert DemandModel().weights(0.0) == {}


# -- units ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("10G", 10240),
        ("10GiB", 10240),
        ("10gb", 10240),
        ("512M", 512),
        ("20480", 20480),
        (20480, 20480),
        ("1.5G", 1536),
        ("0.1M", 1),
        ("1T", 1048576),
        ("2048 KiB", 2),
    ],
)
def test_parse_mib(text: str | int, mib: int) -> None:
    assert parse_mib(text) == mib


@pytest.mark.parametrize("text", ["", "ten", "10Q", "-5", "1e9", "G10", True])
def test_parse_mib_rejects(text: object) -> None:
    with pytest.raises(errors.InvalidRequest):
        parse_mib(text)  # type: ignore[arg-type]


def test_format_mib() -> None:
    assert format_mib(512) == "512 MiB"
    assert format_mib(20480) == "20.0 GiB"


# -- errors -----------------------------------------------------------------------------------


def test_every_error_has_a_unique_code_and_round_trips() -> None:
    codes = [cls.code for cls in errors.ERROR_CLASSES.values()]
    assert len(codes) == len(set(codes))
    for cls in errors.ERROR_CLASSES.values():
        err = (
            cls("something happened", hint="do this")
            if cls is not errors.ConfigError
            else (errors.ConfigError("bad value", where="gpus[1].mode"))
        )
        back = errors.error_from_dict(err.to_dict())
        assert type(back) is cls
        assert back.message == err.message
        assert back.hint == err.hint
        assert isinstance(back, errors.MigdError)


def test_user_facing_errors_carry_a_hint() -> None:
    for cls in (
        errors.RequestTooLarge,
        errors.GpuBusy,
        errors.DriverUnavailable,
        errors.DaemonUnavailable,
        errors.NotAuthorized,
        errors.JobAdError,
        errors.StateStoreError,
        errors.ProtocolError,
        errors.MigModeError,
    ):
        assert cls("x").hint, cls.__name__
