"""``python -m migd.sim``: the report, the plots, and the errors people see."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from migd.sim import cli, report

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def test_compare_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    status = cli.main(
        [
            "--workload",
            "ht1",
            "--policies",
            "exclusive,static,migd",
            "--queue",
            "size",
            "--out",
            str(out),
            "-q",
            "--no-plots",
            "--check",
        ]
    )
    assert status == 0
    text = (out / "report.md").read_text()
    assert "# migd simulation: ht1" in text
    for label in ("exclusive (A)", "static-best (A)", "static-median (A)", "migd (A)"):
        assert f"| {label} |" in text
    assert "Reproduce: `python -m migd.sim" in text
    assert "1g.5gb@6" in text  # the static layouts are listed
    printed = capsys.readouterr().out
    assert "migd (A)" in printed and "report:" in printed


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib not installed")
def test_compare_draws_the_plots(tmp_path: Path) -> None:
    status = cli.main(
        [
            "compare",
            "--workload",
            "hm4",
            "--policies",
            "exclusive,migd",
            "--queue",
            "fifo",
            "--out",
            str(tmp_path),
            "-q",
        ]
    )
    assert status == 0
    for name in ("compare.png", "utilisation.png", "slicemap.png"):
        path = tmp_path / name
        assert path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![slice map](slicemap.png)" in (tmp_path / "report.md").read_text()


def test_report_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "pyplot", lambda: None)
    status = cli.main(
        ["--workload", "hm4", "--policies", "migd", "--queue", "size", "--out", str(tmp_path), "-q"]
    )
    assert status == 0
    text = (tmp_path / "report.md").read_text()
    assert "Plots skipped: matplotlib is not installed" in text
    assert not list(tmp_path.glob("*.png"))


def test_trace_input(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("submit_s,memory_mib,runtime_s\n0,4000,60\n5,30000,60\n")
    status = cli.main(
        [
            "--trace",
            str(trace),
            "--policies",
            "exclusive,migd",
            "--queue",
            "fifo",
            "--out",
            str(tmp_path / "o"),
            "-q",
            "--no-plots",
        ]
    )
    assert status == 0
    assert "t.csv" in (tmp_path / "o" / "report.md").read_text()


def test_growing_trace_adds_the_forecast_policy(tmp_path: Path) -> None:
    trace = tmp_path / "g.csv"
    trace.write_text("submit_s,memory_mib,runtime_s,peak_mib,iterations\n0,4000,60,9000,40\n")
    cli.main(
        [
            "--trace",
            str(trace),
            "--policies",
            "migd",
            "--queue",
            "size",
            "--out",
            str(tmp_path),
            "-q",
            "--no-plots",
        ]
    )
    assert "| migd+forecast (A) |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "nope"], "unknown workload"),
        (["--policies", "magic"], "unknown policy"),
        (["--model", "Z9000"], "no built-in MIG table"),
        (["--trace", "/nonexistent/x.csv"], "cannot read trace"),
    ],
)
def test_errors_say_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status = cli.main([*argv, "--out", str(tmp_path), "-q", "--no-plots"])
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and "hint:" in err


def test_far_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["far", "--n", "12", "--runs", "3", "--show", "-q"]) == 0
    out = capsys.readouterr().out
    assert "rho mean" in out and "create" in out


def test_list_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "ht3" in out and "migd+forecast" in out and "memory_mib" in out
