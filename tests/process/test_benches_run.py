"""The benches whose figures the README quotes still run, at a tiny size.

A bench is not part of the suite, so one can stop working without anybody noticing:
bench/negotiation_scale.py failed for a day after the shipped START came to name a
macro, and bench/history_prune.py would have failed on a removed keyword argument. Here
each bench that needs neither root nor another checkout runs once, small, into a
temporary file, and must exit 0 with its figures printed. The figures themselves are
not checked: on a busy machine they mean nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def bench(*args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ((), "then median"),
        (("--early",), "steps of 1000 rows"),
        (("--start",), "Sweep of 1000 leases"),
    ],
)
def test_history_prune(mode: tuple[str, ...], says: str) -> None:
    out = bench("bench/history_prune.py", "--rows", "2000", "--hours", "2", *mode)
    assert says in out


def test_bench_queue(tmp_path: Path) -> None:
    out_file = tmp_path / "queue.md"
    bench("bench/bench_queue.py", "--ops", "5", "--scales", "10,100", "--out", str(out_file))
    assert "| size | 100 |" in out_file.read_text()


def test_pool_scale(tmp_path: Path) -> None:
    bench("bench/pool_scale.py", "--runs", "1", "--sizes", "2", "--out", str(tmp_path))
    assert "| 2 | 16 |" in (tmp_path / "pool_scale_migd.md").read_text()
