"""MPS accounting and policy (pure): properties over random request sequences, and examples."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from migd.core.mps import (
    MPS_MAX_CLIENTS_VOLTA,
    MpsPool,
    MpsRequest,
    UserPolicy,
    admit,
    can_admit,
    mark_waiting,
    max_clients_for,
    parse_limit_mib,
    pinned_limit_env_value,
    release,
    share_environment,
)
from migd.errors import InvalidRequest, NoCapacity, RequestTooLarge

GPU = "GPU-5f3b1c2a-0000-4000-8000-00000000abcd"


def pool(**kw: object) -> MpsPool:
    settings_: dict[str, object] = {
        "device_uuid": GPU,
        "memory_total_mib": 40960,
        "reserve_mib": 1024,
    }
    settings_.update(kw)
    return MpsPool(**settings_)  # type: ignore[arg-type]


def req(share_id: str, uid: int = 1000, memory_mib: int = 1024, **kw: int) -> MpsRequest:
    return MpsRequest(share_id=share_id, uid=uid, memory_mib=memory_mib, **kw)


# -- state machine: random admit/release/wait sequences ------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Drives one pool with random requests; a simple model says what must happen."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: MpsPool | None = None
        self.counter = 0

    @precondition(lambda self: self.pool is None)
    @rule(
        total=st.integers(min_value=1024, max_value=81920),
        reserve=st.integers(min_value=0, max_value=4096),
        max_clients=st.integers(min_value=1, max_value=MPS_MAX_CLIENTS_VOLTA),
        policy=st.sampled_from(list(UserPolicy)),
    )
    def make_pool(self, total: int, reserve: int, max_clients: int, policy: UserPolicy) -> None:
        self.pool = pool(
            memory_total_mib=total, reserve_mib=reserve, max_clients=max_clients, policy=policy
        )

    @precondition(lambda self: self.pool is not None)
    @rule(
        uid=st.sampled_from([1000, 1001, 1002]),
        memory=st.integers(min_value=1, max_value=40000),
        clients=st.integers(min_value=1, max_value=8),
    )
    def request(self, uid: int, memory: int, clients: int) -> None:
        assert self.pool is not None
        p = self.pool
        self.counter += 1
        r = req(f"s{self.counter}", uid=uid, memory_mib=memory, clients=clients)
        # The model: what the spec says, computed independently of the implementation.
        never = memory * clients > p.capacity_mib or clients > p.max_clients
        other_user = p.policy is UserPolicy.PER_USER and any(s.uid != uid for s in p.shares)
        drained_out = (
            p.policy is UserPolicy.PER_USER
            and p.draining_for_uid is not None
            and p.draining_for_uid != uid
        )
        full = (
            sum(s.memory_mib * s.clients for s in p.shares) + memory * clients > p.capacity_mib
            or sum(s.clients for s in p.shares) + clients > p.max_clients
        )
        if never:
            with pytest.raises(RequestTooLarge):
                can_admit(p, r)
            return
        answer = can_admit(p, r)
        assert answer.ok == (not (other_user or drained_out or full)), answer.reason
        if answer.ok:
            self.pool = admit(p, r)
            assert self.pool.share(r.share_id) == r
        else:
            assert answer.reason
            with pytest.raises(NoCapacity) as info:
                admit(p, r)
            assert info.value.details["reason"] == answer.reason
            if other_user:
                assert answer.waiting_for_uid is not None

    @precondition(lambda self: self.pool is not None and bool(self.pool.shares))
    @rule(data=st.data())
    def release_one(self, data: st.DataObject) -> None:
        assert self.pool is not None
        before = self.pool
        victim = data.draw(st.sampled_from(before.shares))
        after = release(before, victim.share_id)
        assert after.share(victim.share_id) is None
        assert after.free_mib == min(before.capacity_mib, before.free_mib + victim.accounted_mib)
        assert after.clients == before.clients - victim.clients
        assert release(after, victim.share_id) == after  # idempotent
        self.pool = after

    @precondition(lambda self: self.pool is not None)
    @rule(uid=st.sampled_from([1000, 1001, 1002]))
    def wait(self, uid: int) -> None:
        assert self.pool is not None
        self.pool = mark_waiting(self.pool, uid)

    @precondition(lambda self: self.pool is not None)
    @rule()
    def release_everything(self) -> None:
        assert self.pool is not None
        p = self.pool
        for s in p.shares:
            p = release(p, s.share_id)
        assert p.shares == () and p.free_mib == p.capacity_mib and p.clients == 0
        self.pool = p

    @invariant()
    def limits_add_up_and_caps_hold(self) -> None:
        if self.pool is None:
            return
        p = self.pool
        assert sum(s.memory_mib * s.clients for s in p.shares) <= p.capacity_mib
        assert sum(s.clients for s in p.shares) <= p.max_clients
        assert p.used_mib + p.free_mib == p.capacity_mib
        if p.policy is UserPolicy.PER_USER:
            assert len({s.uid for s in p.shares}) <= 1
        assert len({s.share_id for s in p.shares}) == len(p.shares)

    @invariant()
    def survives_persistence(self) -> None:
        if self.pool is not None:
            assert MpsPool.from_dict(self.pool.to_dict()) == self.pool


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


@given(
    memory=st.integers(min_value=1, max_value=1 << 20),
    pct=st.none() | st.integers(min_value=1, max_value=100),
    uuid=st.sampled_from([GPU, "MIG-5f3b1c2a-0000-4000-8000-00000000abcd"]),
)
def test_share_environment_carries_limit_device_and_pipe(
    memory: int, pct: int | None, uuid: str
) -> None:
    share = (
        req("j", memory_mib=memory, thread_percentage=pct) if pct else req("j", memory_mib=memory)
    )
    env = share_environment(share, "/run/migd/mps/x/pipe", uuid, "/run/migd/mps/x/log")
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/migd/mps/x/pipe"
    assert env["CUDA_MPS_LOG_DIRECTORY"] == "/run/migd/mps/x/log"
    assert env["CUDA_VISIBLE_DEVICES"] == uuid
    device, limit = env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split("=")
    assert device == "0"
    assert parse_limit_mib(limit) == memory
    assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == (None if pct is None else str(pct))


# -- examples ---------------------------------------------------------------------------------


def test_capacity_is_memory_minus_reserve_and_a_too_large_request_says_why() -> None:
    p = pool(memory_total_mib=16384, reserve_mib=1024)
    assert p.capacity_mib == 15360
    assert can_admit(p, req("ok", memory_mib=15360)).ok
    with pytest.raises(RequestTooLarge) as info:
        can_admit(p, req("big", memory_mib=15361))
    assert "15361 MiB" in info.value.message and "15360 MiB" in info.value.message
    with pytest.raises(RequestTooLarge, match="4 clients"):
        can_admit(p, req("fork", memory_mib=4000, clients=4))


def test_a_request_that_fits_later_gets_a_reason_for_the_queue() -> None:
    p = admit(pool(memory_total_mib=8192, reserve_mib=0), req("a", memory_mib=6144))
    answer = can_admit(p, req("b", memory_mib=4096))
    assert not answer.ok and "2048 MiB" in answer.reason
    with pytest.raises(NoCapacity):
        admit(p, req("b", memory_mib=4096))
    assert can_admit(release(p, "a"), req("b", memory_mib=4096)).ok


def test_per_user_serialises_users_and_a_waiting_user_drains_the_device() -> None:
    p = admit(pool(), req("a1", uid=1000))
    refused = can_admit(p, req("b1", uid=2000))
    assert not refused.ok and refused.waiting_for_uid == 1000 and "uid 1000" in refused.reason
    p = mark_waiting(p, 2000)
    # the current owner may not top up any more, so uid 2000 is not starved
    assert not can_admit(p, req("a2", uid=1000)).ok
    p = release(p, "a1")
    assert not can_admit(p, req("a3", uid=1000)).ok
    p = admit(p, req("b1", uid=2000))
    assert p.owner_uid == 2000 and p.draining_for_uid is None
    assert can_admit(p, req("b2", uid=2000)).ok


def test_multi_user_mixes_users_within_memory_and_client_caps() -> None:
    p = pool(policy=UserPolicy.MULTI_USER, max_clients=2)
    p = admit(p, req("a", uid=1000))
    p = admit(p, req("b", uid=2000))
    assert p.owner_uid is None and {s.uid for s in p.shares} == {1000, 2000}
    answer = can_admit(p, req("c", uid=3000))
    assert not answer.ok and "client" in answer.reason
    assert mark_waiting(p, 3000) == p


def test_duplicate_share_id_is_refused() -> None:
    p = admit(pool(), req("a"))
    assert not can_admit(p, req("a")).ok


def test_client_cap_under_mig_is_proportional_to_the_compute_instance() -> None:
    assert max_clients_for() == 48
    assert max_clients_for(60) == 60
    assert max_clients_for(48, compute_slices=7, total_compute_slices=7) == 48
    assert max_clients_for(48, compute_slices=3, total_compute_slices=7) == 20
    assert max_clients_for(48, compute_slices=1, total_compute_slices=7) == 6
    assert max_clients_for(2, compute_slices=1, total_compute_slices=7) == 1
    with pytest.raises(InvalidRequest):
        max_clients_for(48, compute_slices=8, total_compute_slices=7)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"memory_mib": 0}, "positive"),
        ({"clients": 0}, "at least one client"),
        ({"thread_percentage": 0}, "1-100"),
        ({"thread_percentage": 101}, "1-100"),
        ({"uid": -1}, "negative"),
    ],
)
def test_malformed_requests_are_rejected(kwargs: dict[str, int], match: str) -> None:
    base = {"share_id": "x", "uid": 1000, "memory_mib": 1024}
    base.update(kwargs)
    with pytest.raises(InvalidRequest, match=match):
        MpsRequest(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        ("4096M", 4096),
        ("3G", 3072),
        ("512MB", 512),
        ("2GB", 2048),
        (" 1G\n", 1024),
        ("", None),
        ("lots", None),
    ],
)
def test_parse_limit_reads_what_the_daemon_prints(text: str, mib: int | None) -> None:
    assert parse_limit_mib(text) == mib


def test_pinned_limit_env_uses_device_zero_and_mib() -> None:
    assert pinned_limit_env_value(4096) == "0=4096M"
    with pytest.raises(InvalidRequest):
        pinned_limit_env_value(0)


def test_unreadable_pool_record_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest):
        MpsPool.from_dict({"device_uuid": GPU})
