"""``python -m migd.policysim``: the report, the plots, and the errors people see."""

from __future__ import annotations

import importlib.util
import io
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from migd.policysim import cli, report
from migd.policysim.progress import ProgressBar

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
    assert "Reproduce: `python -m migd.policysim" in text
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


@pytest.mark.parametrize("model", ["A30-24GB", "H100-80GB"])
def test_model_rebuilds_the_workload_for_that_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str
) -> None:
    # ht3's "full" jobs ask for most of the GPU the workload is built for: on an A30 they
    # must fit (built for A100 they would all be refused), on an H100 they ask for more
    # than an A100 has
    argv = ["--workload", "ht3", "--model", model, "--policies", "migd", "--queue", "size"]
    assert cli.main([*argv, "--out", str(tmp_path), "-q", "--no-plots", "--check"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert f"(rebuilt for {model})" in text and f"x 1 {model}," in text
    assert "| migd (A) | 36/36 |" in text
    from migd.core.catalog import geometry
    from migd.policysim.workloads import WORKLOADS

    memory = geometry(model).memory_mib
    full = [j.memory_mib for j in WORKLOADS["ht3"].build(1, model) if j.kind == "full"]
    assert memory // 2 < max(full) <= memory


def test_incomplete_runs_are_marked_and_the_baseline_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # no exclusive run: ratios are against the first row, and the table says so; the
    # static median layout cannot run ht3's full jobs, so its throughput gets a dagger
    argv = ["--workload", "ht3", "--policies", "static,migd", "--queue", "fifo"]
    assert cli.main([*argv, "--out", str(tmp_path), "-q", "--no-plots"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| vs static-best (B) |" in text and "vs exclusive" not in text
    median = next(line for line in text.splitlines() if line.startswith("| static-median (B)"))
    assert "/36 |" in median and "x †" in median
    migd = next(line for line in text.splitlines() if line.startswith("| migd (B)"))
    assert "36/36" in migd and "†" not in migd
    assert "† the policy did not complete every job" in text
    out = capsys.readouterr().out
    assert "ratios are vs static-best (B)" in out
    printed = next(line for line in out.splitlines() if "static-median (B)" in line)
    assert "†" in printed
    assert "†" not in next(line for line in out.splitlines() if "migd (B)" in line)


def test_progress_moves_within_one_long_simulation(tmp_path: Path) -> None:
    from migd.policysim.compare import compare
    from migd.policysim.workloads import kit_mix

    fractions: list[float] = []
    compare(
        kit_mix(60),
        policies=["exclusive"],
        queue="fifo",
        on_step=lambda policy, fraction: fractions.append(fraction),
    )
    assert len(fractions) >= 10
    assert fractions == sorted(fractions) and 0 < fractions[0] < fractions[-1] <= 1.0


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_partial_steps_on_a_terminal_only() -> None:
    tty = _Tty()
    bar = ProgressBar(4, "sim", stream=tty)
    bar.partial(0.5, "migd (A)")
    assert "0.5/4" in tty.getvalue() and "migd (A)" in tty.getvalue()
    log = io.StringIO()
    bar = ProgressBar(4, "sim", stream=log)  # not a terminal: silent unless enabled
    bar.partial(0.5)
    bar.update(1)
    assert log.getvalue() == ""
    quiet = ProgressBar(4, "sim", stream=_Tty(), enabled=False)
    quiet.partial(0.5)
    quiet.update(1)
    assert quiet.stream.getvalue() == ""  # type: ignore[attr-defined]


def test_no_progress_output_when_not_a_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", "hm4", "--policies", "migd", "--queue", "size", "--no-plots"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


def test_list_into_a_closed_pipe_ends_quietly() -> None:
    # `python -m migd.policysim list | head -1` must not end with a BrokenPipeError traceback
    proc = subprocess.run(
        f"{shlex.quote(sys.executable)} -m migd.policysim list | head -1",
        shell=True,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.stdout == "Workloads:\n"
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_far_plans_several_gpus_and_other_p_sup(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["far", "--n", "20", "--runs", "2", "--gpus", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "on 2 x A100-40GB" in out and "p_sup=0," in out
    rho = float(out.split("rho mean ")[1].split()[0])
    assert rho >= 1.0  # against the bound of both GPUs' slices
    assert cli.main(["far", "--n", "12", "--runs", "2", "--p-sup", "0.5", "-q"]) == 0
    assert "p_sup=0.5," in capsys.readouterr().out
    assert cli.main(["far", "--gpus", "9", "-q"]) == 2
    assert "--gpus must be 1-8" in capsys.readouterr().err


# -- `migctl simulate`: the same command behind migctl's parser ----------------------------------


@pytest.mark.parametrize(
    "prefix",
    [
        ["simulate"],
        ["--socket", "/nonexistent/migd.sock", "simulate"],
        ["-v", "--socket", "/nonexistent/migd.sock", "simulate"],  # simulate is the 4th word
    ],
)
def test_migctl_simulate_passes_everything_after_it_on(
    prefix: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from migd.cli import migctl

    assert migctl.main([*prefix, "far", "--n", "12", "--runs", "2", "-q"]) == 0
    assert "rho mean" in capsys.readouterr().out


def test_migctl_simulate_defaults_to_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from migd.cli import migctl

    argv = ["--workload", "hm4", "--policies", "migd", "--queue", "size", "--no-plots", "-q"]
    assert migctl.main(["simulate", *argv, "--out", str(tmp_path)]) == 0
    assert "# migd simulation: hm4" in (tmp_path / "report.md").read_text()
    assert "report:" in capsys.readouterr().out


def test_migctl_simulate_help_is_the_simulators(capsys: pytest.CaptureFixture[str]) -> None:
    from migd.cli import migctl

    with pytest.raises(SystemExit) as done:
        migctl.main(["simulate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: migctl simulate") and "{compare,far,list}" in out
    with pytest.raises(SystemExit) as done:
        migctl.main(["simulate", "far", "--bogus"])
    assert done.value.code == 2
    assert "migctl simulate: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_migctl_simulate_is_a_word_only_where_a_command_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A socket named "simulate" is a socket; other commands still refuse unknown options."""
    from migd.cli import migctl

    monkeypatch.chdir(tmp_path)  # no socket called "simulate" here
    assert migctl.main(["--socket", "simulate", "status"]) == migctl.EXIT_DOWN
    assert "rho mean" not in capsys.readouterr().out
    assert migctl.main(["status", "--bogus"]) == migctl.EXIT_USAGE
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert migctl.main(["status", "simulate"]) == migctl.EXIT_USAGE
