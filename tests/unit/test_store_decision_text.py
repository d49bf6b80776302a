"""The state store encodes a lease's decision once and reuses the text (issue 26 §4:
the decision was encoded three or four times per lease cycle). What is stored must not
change: the lease row byte for byte, the history row as the same JSON."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migd.core.leases import Lease, LeaseEvent, LeaseRequest
from migd.daemon.store.state import DecisionText, StateStore, lease_to_json

MARK = "\x00decision\x00"


def decision() -> dict[str, Any]:
    return {
        "action": "create",
        "reason": "GPU 0 (A100-40GB): create 1g.5gb@6; reachability after 33",
        "cost_s": 0.16,
        "utilisation_after": 0.1333,
        "other_gpus": [{"gpu": g, "cost_s": 0.16, "start": 6} for g in range(1, 8)],
        "alternatives": [{"start": s, "score": 21.0 + s} for s in range(7)],
    }


def lease(job_id: str = "1.0", lease_id: str = "L1") -> Lease:
    x = Lease(lease_id, LeaseRequest(job_id, 4000), owner_uid=1, owner_pid=2, created_s=0.5)
    x.decision = decision()
    return x


def row(path: Path, lease_id: str) -> str:
    with sqlite3.connect(path) as db:
        return str(
            db.execute("SELECT data FROM leases WHERE lease_id=?", (lease_id,)).fetchone()[0]
        )


def test_each_saved_lease_row_is_what_encoding_it_whole_gives(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    x = lease()
    for event in (LeaseEvent.PLAN, LeaseEvent.READY, LeaseEvent.RELEASE):
        x.event(event, 1.0)
        store.save_lease(x)
        assert row(tmp_path / "state.db", "L1") == lease_to_json(x)
    store.close()


def test_a_decision_changed_in_place_is_encoded_again() -> None:
    decisions = DecisionText()
    x = lease()
    first = lease_to_json(x, decisions)
    assert first == lease_to_json(x)
    assert x.decision is not None
    x.decision["reason"] = "hybrid: MPS on the MIG instance. " + x.decision["reason"]
    assert lease_to_json(x, decisions) == lease_to_json(x) != first
    x.decision["hybrid"] = "MPS on the MIG instance"  # a key added
    assert lease_to_json(x, decisions) == lease_to_json(x)
    x.decision = decision()  # a new decision object with an equal reason
    x.decision["cost_s"] = 9.5
    assert lease_to_json(x, decisions) == lease_to_json(x)


@settings(max_examples=200, deadline=None)
@given(
    job_id=st.lists(st.sampled_from(["a", "\x00", "decision", '"', "\\"]), max_size=12).map(
        "".join
    ),
    reason=st.lists(st.sampled_from(["x", "\x00", "decision", MARK]), max_size=8).map("".join),
)
def test_client_text_that_holds_the_placeholder_is_stored_as_it_is(
    job_id: str, reason: str
) -> None:
    decisions = DecisionText()
    x = lease(job_id=job_id)
    x.reason = reason  # comes after "decision" in the sorted keys
    assert x.decision is not None
    x.decision["note"] = reason  # and inside the decision itself
    text = lease_to_json(x, decisions)
    assert text == lease_to_json(x)
    assert json.loads(text)["request"]["job_id"] == job_id


def test_the_granted_history_row_keeps_the_decision_and_the_rest(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    x = lease(job_id=f"job {MARK}")
    data = {"gpu": 0, "profile": "1g.5gb", "note": MARK, "decision": x.decision, "seconds": None}
    store.record("granted", data, lease_id="L1", job_id=x.request.job_id, t=1.0)
    store.save_lease(x)  # the same decision text, taken from the cache
    (got,) = store.history(job_id=x.request.job_id)
    assert got.data == data
    assert json.loads(row(tmp_path / "state.db", "L1"))["decision"] == x.decision
    store.close()


def test_the_cache_holds_live_leases_only(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    leases = [lease(lease_id=f"L{n}") for n in range(20)]
    for x in leases:
        x.event(LeaseEvent.PLAN, 1.0)
        store.save_lease(x)
    assert len(store.decisions) == 20
    for x in leases:
        x.event(LeaseEvent.RELEASE, 2.0)
        store.save_lease(x)
    assert len(store.decisions) == 0
    store.close()


def test_the_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DecisionText, "MAX_ENTRIES", 8)
    decisions = DecisionText()
    for n in range(50):
        x = lease(lease_id=f"L{n}")
        assert lease_to_json(x, decisions) == lease_to_json(x)
    assert len(decisions) == 8
