"""A job without a GPU is exec()ed by the light entry: the same process as without migd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENTRY = "import sys; from migd.wrapper.entry import wrapper_main; sys.exit(wrapper_main())"
CPU_AD = 'GlobalJobId = "ap#13.0#1700000000"\nClusterId = 13\nProcId = 0\nRequestCpus = 1\n'


def job_env(tmp_path: Path, ad: str = CPU_AD) -> dict[str, str]:
    path = tmp_path / "job.ad"
    path.write_text(ad)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("_CONDOR_", "MIGD_"))}
    # No daemon anywhere: a job that took the GPU path would fail, not run.
    return {**env, "_CONDOR_JOB_AD": str(path), "MIGD_API_SOCKET": str(tmp_path / "none.sock")}


def wrapped(tmp_path: Path, *command: str, ad: str = CPU_AD) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", ENTRY, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=job_env(tmp_path, ad),
    )


def test_the_job_is_the_wrappers_own_process(tmp_path: Path) -> None:
    proc = wrapped(tmp_path, "/bin/sh", "-c", 'echo "$$ $PPID"')
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    pid, ppid = (int(x) for x in out.split())
    assert pid == proc.pid and ppid == os.getpid()  # exec'd: no wrapper process in between


@pytest.mark.parametrize("code", [0, 3, 86, 255])
def test_exit_codes_pass_through(tmp_path: Path, code: int) -> None:
    proc = wrapped(tmp_path, "/bin/sh", "-c", f"exit {code}")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err == ""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM])
def test_a_job_killed_by_a_signal_is_reported_killed_by_it(tmp_path: Path, signum: int) -> None:
    proc = wrapped(tmp_path, "/bin/sh", "-c", f"kill -{signum} $$; sleep 30")
    proc.communicate(timeout=60)
    assert proc.returncode == -signum


def test_a_signal_sent_to_the_wrapper_reaches_the_job(tmp_path: Path) -> None:
    """Any signal, not only the six the supervising path forwards (here SIGWINCH)."""
    proc = wrapped(
        # It waits in sleeps, not `read`: stdin may be at its end already (pytest-xdist's
        # workers), and a read that returned ends the job before the signal arrives.
        tmp_path,
        "/bin/sh",
        "-c",
        "trap 'echo got WINCH; exit 7' WINCH; echo ready; while :; do sleep 0.2; done",
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"  # the trap is set
    proc.send_signal(signal.SIGWINCH)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7 and "got WINCH" in out


def signal_state(stdout: str) -> dict[str, str]:
    fields = ("SigIgn", "SigBlk", "SigCgt")
    return {
        k: v.strip()
        for k, _, v in (line.partition(":") for line in stdout.splitlines())
        if k in fields
    }


def test_the_job_gets_the_signal_dispositions_of_a_plain_start(tmp_path: Path) -> None:
    """Python ignores SIGPIPE and SIGXFSZ, and an exec keeps ignored signals ignored: a job
    that writes to a closed pipe would see EPIPE instead of dying as it does without migd."""
    probe = ["/bin/cat", "/proc/self/status"]
    plain = subprocess.run(probe, capture_output=True, text=True, check=True, timeout=60)
    proc = wrapped(tmp_path, *probe)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert signal_state(out) == signal_state(plain.stdout)
    assert signal_state(out)["SigIgn"]  # the probe read the fields


@pytest.mark.parametrize(("name", "code"), [("missing", 127), ("not-executable", 126)])
def test_a_job_that_cannot_be_executed_fails_like_in_a_shell(
    tmp_path: Path, name: str, code: int
) -> None:
    command = str(tmp_path / name)
    if name == "not-executable":
        Path(command).write_text("#!/bin/sh\n")
        Path(command).chmod(0o644)  # no x bit: EACCES, for root too
    proc = wrapped(tmp_path, command)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert f"cannot start the job '{command}'" in err and f"exiting with {code}" in err


def test_an_ad_the_light_parse_is_unsure_of_still_runs_a_cpu_job(tmp_path: Path) -> None:
    """An expression goes to the full path (the HTCondor bindings), which execs it too."""
    ad = "ClusterId = 13\nProcId = 0\nRequestGPUs = ifThenElse(false, 1, 0)\n"
    proc = wrapped(tmp_path, "/bin/sh", "-c", 'echo "$$"; exit 5', ad=ad)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5 and int(out) == proc.pid, err
