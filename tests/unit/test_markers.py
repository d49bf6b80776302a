"""tests/conftest.py: the process tier is slow by directory; gpu tests are opt-in."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import GPU_OPT_IN, apply_markers


class Item:
    """What apply_markers reads of a collected test: its path and its markers."""

    def __init__(self, path: Path, *marks: str) -> None:
        self.path = path
        self.marks = list(marks)
        self.skip_reason: str | None = None

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.marks else None

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.marks.append(marker.name)
        if marker.name == "skip":
            self.skip_reason = marker.kwargs["reason"]


def test_the_process_tier_is_slow_and_nothing_else_by_directory(tmp_path: Path) -> None:
    process = Item(tmp_path / "process" / "test_daemon_process.py")
    nested = Item(tmp_path / "process" / "more" / "test_x.py")
    unit = Item(tmp_path / "unit" / "test_process_names.py")
    apply_markers([process, nested, unit], root=tmp_path, environ={})  # type: ignore[list-item]
    assert process.marks == ["slow"] and nested.marks == ["slow"]
    assert unit.marks == []


def test_gpu_tests_run_only_when_opted_in(tmp_path: Path) -> None:
    skipped = Item(tmp_path / "backends" / "test_real.py", "gpu")
    apply_markers([skipped], root=tmp_path, environ={})  # type: ignore[list-item]
    assert skipped.skip_reason is not None and GPU_OPT_IN in skipped.skip_reason
    runs = Item(tmp_path / "backends" / "test_real.py", "gpu")
    apply_markers([runs], root=tmp_path, environ={GPU_OPT_IN: "1"})  # type: ignore[list-item]
    assert runs.marks == ["gpu"]
