"""Waiting in tests: for a condition, never for a fixed time.

The suite runs beside other work: on a 2-core host at load 15 a daemon's start-up took 3-7 s
and one request could take a second or more. A limit here is therefore the point at which a
wait is called a hang, not how long the thing should take; the figure a test cares about (a
speed) belongs to ``bench/``. ``MIGD_TEST_PATIENCE`` multiplies every limit for hosts slower
still. Each wait says what it waited for, how long, and what it saw last, so a failure reads
as a sentence rather than a bare timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Multiplies every limit (``MIGD_TEST_PATIENCE=3`` on a very slow host).
PATIENCE = float(os.environ.get("MIGD_TEST_PATIENCE", "1") or "1")

#: How long a wait may take before it is called a hang: far above what a loaded host needs.
DEFAULT_LIMIT_S = 60.0


def limit(seconds: float) -> float:
    """``seconds`` scaled by ``MIGD_TEST_PATIENCE``: for a timeout passed to something else."""
    return seconds * PATIENCE


def wait_for(
    cond: Callable[[], T],
    timeout_s: float = DEFAULT_LIMIT_S,
    what: str = "",
    *,
    interval_s: float = 0.05,
    give_up: Callable[[], str | None] | None = None,
) -> T:
    """Poll ``cond`` until it returns something truthy, and return that.

    ``give_up`` is asked between polls: a string from it ends the wait at once with that
    reason (a daemon that exited will never become ready, so waiting out the limit would
    only hide why).
    """
    deadline = time.monotonic() + limit(timeout_s)
    last: Any = None
    while True:
        last = cond()
        if last:
            return last
        if give_up is not None and (reason := give_up()):
            raise AssertionError(f"gave up waiting for {what or cond}: {reason}")
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {limit(timeout_s):.0f} s waiting for {what or cond} "
                f"(last seen: {last!r})"
            )
        time.sleep(interval_s)
