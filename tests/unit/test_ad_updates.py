"""When the node's ad goes to the collector (``update:true``) and when only to the startd."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migd.core.ad_updates import AdUpdates, matched_part


def _ad(largest: int, queued: int = 0, healthy: bool = True) -> str:
    return (
        f"MigdHealthy = {'true' if healthy else 'false'}\n"
        f"MigdLargestPlaceableMB = {largest}\n"
        f"MigdFreeMB = {largest + queued}\n"
        f"MigdQueued = {queued}\n"
        "- migd\n"
    )


def test_the_first_ad_goes_to_the_collector_and_a_repeat_goes_nowhere() -> None:
    u = AdUpdates(rand=lambda: 0.0)
    first = u.look(_ad(40448), 0.0)
    assert first is not None and first.update and first.why == "changed"
    assert u.look(_ad(40448), 1.0) is None
    assert u.look(_ad(40448), 599.0) is None


def test_a_change_no_matcher_reads_reaches_the_startd_without_a_collector_update() -> None:
    u = AdUpdates(rand=lambda: 0.0)
    u.look(_ad(40448), 0.0)
    queued = u.look(_ad(40448, queued=3), 5.0)
    assert queued is not None and not queued.update and "MigdQueued = 3" in queued.ad


def test_a_freed_partition_goes_to_the_collector_at_once() -> None:
    u = AdUpdates(rand=lambda: 0.0, min_gap_s=1.0)
    u.look(_ad(0), 0.0)
    freed = u.look(_ad(40448), 30.0)
    assert freed is not None and freed.update and "MigdLargestPlaceableMB = 40448" in freed.ad


def test_a_burst_of_changes_becomes_one_update_after_the_gap() -> None:
    u = AdUpdates(rand=lambda: 0.0, min_gap_s=1.0)
    u.look(_ad(0), 0.0)
    a = u.look(_ad(4864), 0.25)
    b = u.look(_ad(9728), 0.5)
    assert a is not None and b is not None
    assert (a.update, b.update) == (False, False)  # the startd has them: START sees them
    c = u.look(_ad(9728), 1.0)
    assert c is not None and c.update and c.why == "changed" and c.ad == b.ad
    assert u.look(_ad(9728), 1.25) is None


def test_the_keep_alive_is_jittered_below_its_period() -> None:
    draws = iter([0.0, 0.5, 0.99])
    u = AdUpdates(rand=lambda: next(draws), keepalive_s=600.0, jitter=0.2)
    u.look(_ad(1), 0.0)  # next keep-alive at 600 (draw 0.0)
    assert u.look(_ad(1), 599.5) is None
    k1 = u.look(_ad(1), 600.0)
    assert k1 is not None and k1.update and k1.why == "keep-alive"
    # draw 0.5: 600 * (1 - 0.2 * 0.5) = 540 s later
    assert u.look(_ad(1), 600.0 + 539.5) is None
    k2 = u.look(_ad(1), 600.0 + 540.0)
    assert k2 is not None and k2.why == "keep-alive"


def test_an_unavailable_daemon_is_a_matched_change() -> None:
    u = AdUpdates(rand=lambda: 0.0)
    u.look(_ad(40448), 0.0)
    down = u.look('MigdHealthy = false\nMigdHealthReason = "down"\n- migd\n', 10.0)
    assert down is not None and down.update


def test_matched_part_keeps_what_matchers_read() -> None:
    ad = _ad(40448, queued=2) + 'SlotMergeConstraint = regexp("x", AssignedGPUs ?: "")\n'
    part = matched_part(ad)
    assert "MigdLargestPlaceableMB" in part and "SlotMergeConstraint" in part
    assert "MigdQueued" not in part and "MigdFreeMB" not in part


@pytest.mark.parametrize(
    "kwargs", [{"min_gap_s": -1.0}, {"keepalive_s": 0.0}, {"jitter": 1.0}, {"jitter": -0.1}]
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AdUpdates(rand=lambda: 0.0, **kwargs)


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(
        st.tuples(st.floats(0.05, 5.0), st.sampled_from([0, 4864, 9728, 40448]), st.integers(0, 3)),
        min_size=1,
        max_size=80,
    ),
    min_gap=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
)
def test_the_collector_is_never_behind_for_longer_than_the_gap(
    seed: int, steps: list[tuple[float, int, int]], min_gap: float
) -> None:
    """Over any sequence of looks: the startd always has the newest ad; the collector has
    the newest matched values at the first look ``min_gap_s`` after its last update; updates
    for changes are at least ``min_gap_s`` apart; no update without a reason."""
    rng = random.Random(seed)
    u = AdUpdates(rand=rng.random, min_gap_s=min_gap, keepalive_s=20.0, jitter=0.5)
    now, startd, collector, last_update = 0.0, None, None, float("-inf")
    for dt, largest, queued in steps:
        now += dt
        ad = _ad(largest, queued)
        p = u.look(ad, now)
        if p is not None:
            assert p.ad == ad
            assert p.ad != startd or p.update
            startd = p.ad
            if p.update:
                if p.why == "changed":
                    assert now - last_update >= min_gap
                    assert collector is None or matched_part(collector) != matched_part(ad)
                else:
                    assert p.why == "keep-alive" and now - last_update >= 20.0 * 0.5
                collector, last_update = p.ad, now
        assert startd == ad
        if now - last_update >= min_gap:
            assert collector is not None and matched_part(collector) == matched_part(ad)
