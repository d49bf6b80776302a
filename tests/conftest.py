"""Markers by directory, so that a tier's tests need no decorator each.

``slow`` and ``htcondor`` select the tiers the fast subset leaves out
(``pytest -m "not slow and not htcondor"``, README "Development"):

* ``tests/process``: migd and the wrapper as real processes, with real sockets,
  signals and timeouts (seconds per test): ``slow``.
* ``tests/integration``: the real HTCondor pool; its own conftest marks each test
  ``htcondor``.

Elsewhere a test is marked ``slow`` where it is defined, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
SLOW_DIRECTORIES = ("process",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = {TESTS / name for name in SLOW_DIRECTORIES}
    for item in items:
        if slow & set(item.path.parents):
            item.add_marker(pytest.mark.slow)
