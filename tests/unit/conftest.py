"""Fixtures shared by the unit tests of the state database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from migd.daemon.store.state import StateStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    """A state database of its own, closed after the test."""
    s = StateStore(tmp_path / "migd.db")
    try:
        yield s
    finally:
        s.close()
