"""Signals, exit status and checkpoints through the forking wrapper, as processes.

What HTCondor's starter does is reproduced where it matters: it signals only the
wrapper (``JobPid``); with ``USE_PID_NAMESPACES`` the wrapper is PID 1 and runs
``condor_pid_ns_init`` (a stand-in below, written from condor_pid_ns_init.cpp), and
the starter takes the job's end from that program's status file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.process.conftest import DaemonProcess, wait_for
from tests.process.test_wrapper_process import _unshare_works, active, fake_chirp, wrapper

AD = "ClusterId = 31\nProcId = 0\nRequestGPUs = 1\nRequestVRAM = 4000\nWantIOProxy = true\n"
RT = int(signal.SIGRTMIN) + 3
WRAPPER = [
    sys.executable,
    "-c",
    "import sys; from migd.wrapper.main import wrapper_main; sys.exit(wrapper_main(sys.argv[1:]))",
]
# condor_pid_ns_init.cpp, line for line: handlers that pass ten signals to the child,
# fork + exec, then "Exited: <wait status>" into the status file unless it exists.
PID_NS_INIT = textwrap.dedent("""\
    #!{python}
    import os, signal, sys
    child = 0
    def forward(sig, frame):
        if child > 0:
            os.kill(child, sig)
    path = os.environ.get("_CONDOR_PID_NS_INIT_STATUS_FILENAME")
    if path and os.path.exists(path):
        os.unlink(path)
    for s in ("HUP", "INT", "QUIT", "ILL", "ABRT", "TERM", "SEGV", "PIPE", "USR1", "USR2"):
        signal.signal(getattr(signal, "SIG" + s), forward)
    child = os.fork()
    if child == 0:
        os.execv(sys.argv[1], sys.argv[1:])
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    if path and not os.path.exists(path):
        with open(path, "w") as f:
            f.write("Exited: %d\\n" % status)
    sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 0)
""")


def recorder(marker: Path, exit_on: str, code: int) -> str:
    """A job that writes each signal it gets to ``marker`` and exits ``code`` on one."""
    return textwrap.dedent(f"""
        import os, signal, sys, time
        def got(sig, frame):
            with open({str(marker)!r}, "a") as f:
                f.write(signal.Signals(sig).name if sig < signal.SIGRTMIN else "RT%d" % sig)
                f.write("\\n")
            if sig == signal.{exit_on}:
                sys.exit({code})
        for s in (signal.SIGALRM, signal.SIGUSR1, signal.SIGTERM, {RT}):
            signal.signal(s, got)
        print("ready", os.getpid(), flush=True)
        while True:
            time.sleep(0.05)
    """)


def start(
    daemon: DaemonProcess,
    tmp_path: Path,
    ad_text: str,
    *command: str,
    outer: list[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    ad = tmp_path / "job.ad"
    ad.write_text(ad_text)
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700, exist_ok=True)
    return subprocess.Popen(
        [*outer, *WRAPPER, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={
            **os.environ,
            "_CONDOR_JOB_AD": str(ad),
            "_CONDOR_SCRATCH_DIR": str(scratch),
            "_CONDOR_WRAPPER_ERROR_FILE": str(scratch / ".job_wrapper_failure"),
            "_CONDOR_PID_NS_INIT_STATUS_FILENAME": str(scratch / ".condor_pid_ns_status"),
            "MIGD_API_SOCKET": str(daemon.socket_path),
            "MIGD_SAMPLE_INTERVAL_S": "0.1",
            **(env or {}),
        },
    )


def ready_pid(proc: subprocess.Popen[str], jobs: list[int]) -> int:
    """The job's pid from its "ready" line (kept in ``jobs`` for the clean-up)."""
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line[:1] == ["ready"], (line, proc.stderr.read() if proc.stderr else "")
    jobs.append(int(line[1]))
    return int(line[1])


def clean_up(proc: subprocess.Popen[str], jobs: list[int]) -> None:
    """Kill the wrapper's session and the job's own process group (a wrapper that died
    first leaves the job running, holding the pipes open)."""
    for group in (proc.pid, *jobs):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    proc.communicate(timeout=60)


def state(pid: int) -> str:
    """The process state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_any_kill_and_checkpoint_signal_and_suspend_reach_the_job(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # kill_sig = SIGALRM and a real-time checkpoint signal: before, the first killed the
    # wrapper (Python's default) and the job with it, unheard; SIGTSTP stopped only the
    # wrapper.
    daemon.start()
    marker = tmp_path / "got"
    ad = AD + f'KillSig = "SIGALRM"\nCheckpointSig = {RT}\nWantCheckpointSignal = true\n'
    proc = start(daemon, tmp_path, ad, sys.executable, "-c", recorder(marker, "SIGALRM", 7))
    jobs: list[int] = []
    try:
        job = ready_pid(proc, jobs)
        wait_for(lambda: active(daemon), what="the job's lease")
        proc.send_signal(RT)
        wait_for(lambda: f"RT{RT}" in lines(marker), what="the checkpoint signal at the job")
        proc.send_signal(signal.SIGTSTP)
        wait_for(lambda: state(job) == "T", what="the job to be stopped by SIGTSTP")
        assert proc.poll() is None and state(proc.pid) != "T"  # the wrapper still watches
        proc.send_signal(signal.SIGCONT)
        wait_for(lambda: state(job) != "T", what="the job to continue on SIGCONT")
        proc.send_signal(signal.SIGALRM)
        assert proc.wait(60) == 7
        assert lines(marker) == [f"RT{RT}", "SIGALRM"]
        assert active(daemon) == []
    finally:
        clean_up(proc, jobs)


def pid_ns_init(tmp_path: Path) -> Path:
    path = tmp_path / "libexec" / "condor_pid_ns_init"
    path.parent.mkdir(exist_ok=True)
    path.write_text(PID_NS_INIT.format(python=sys.executable))
    path.chmod(0o755)
    return path


UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def test_pid_namespace_signals_reach_the_job_once_and_its_end_is_recorded(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # USE_PID_NAMESPACES: the wrapper is PID 1, condor_pid_ns_init its child. Before,
    # the wrapper signalled the process group (condor_pid_ns_init and the job), and
    # condor_pid_ns_init passed the signal on again: the job got SIGUSR1 twice.
    why = _unshare_works()
    if why:
        pytest.skip(why)
    daemon.start()
    marker = tmp_path / "got"
    init = pid_ns_init(tmp_path)
    job = [str(init), sys.executable, "-c", recorder(marker, "SIGTERM", 0)]
    proc = start(daemon, tmp_path, AD, *job, outer=UNSHARE)
    status = tmp_path / "scratch" / ".condor_pid_ns_status"
    jobs: list[int] = []  # (its pid is the namespace's; killing PID 1 ends them all)
    try:
        ready_pid(proc, [])
        [wrapper_pid] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        os.kill(int(wrapper_pid), signal.SIGUSR1)  # from outside, as the starter does
        wait_for(lambda: "SIGUSR1" in lines(marker), what="SIGUSR1 at the job")
        os.kill(int(wrapper_pid), signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
        assert lines(marker) == ["SIGUSR1", "SIGTERM"]
        assert status.read_text() == "Exited: 0\n"
        assert active(daemon) == []
    finally:
        clean_up(proc, jobs)


def test_pid_namespace_job_killed_by_a_signal_is_recorded_as_such(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    why = _unshare_works()
    if why:
        pytest.skip(why)
    daemon.start()
    init = pid_ns_init(tmp_path)
    proc = start(daemon, tmp_path, AD, str(init), "/bin/sh", "-c", "kill -SEGV $$", outer=UNSHARE)
    proc.communicate(timeout=120)
    # the starter's pidNameSpaceReaper: WIFSIGNALED, WTERMSIG 11 (ExitBySignal, ExitSignal)
    status = (tmp_path / "scratch" / ".condor_pid_ns_status").read_text()
    assert status == f"Exited: {int(signal.SIGSEGV)}\n"


def test_pid_namespace_wrapper_failure_is_what_the_starter_reads(tmp_path: Path) -> None:
    # migd down: the wrapper exits 1 with the error file and no job ever ran. Before,
    # there was no status file, and the starter stops with "condor_pid_ns_init did not
    # run properly" (vanilla_proc.cpp pidNameSpaceReaper) instead of showing the reason.
    init = pid_ns_init(tmp_path)
    result, error_file = wrapper(
        None,
        tmp_path,
        AD,
        str(init),
        "/bin/true",
        env={"_CONDOR_PID_NS_INIT_STATUS_FILENAME": str(tmp_path / "scratch" / "st")},
    )
    assert result.returncode == 1 and error_file.exists(), result.stderr
    assert (tmp_path / "scratch" / "st").read_text() == f"Exited: {1 << 8}\n"


def test_pid_one_without_pid_ns_init_dies_of_the_jobs_segfault(daemon: DaemonProcess) -> None:
    # USE_PID_NAMESPACE_INIT = False: the kernel ignores a signal PID 1 sends itself;
    # before, the wrapper fell through to exit 139 (ExitBySignal = false).
    why = _unshare_works()
    if why:
        pytest.skip(why)
    daemon.start()
    result = subprocess.run(
        [
            *UNSHARE,
            sys.executable,
            "-m",
            "migd.wrapper.main",
            "--socket",
            str(daemon.socket_path),
            "--gpu-memory",
            "1G",
            "--",
            "/bin/sh",
            "-c",
            "kill -SEGV $$",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # unshare --fork dies of its child's signal
    assert result.returncode == -signal.SIGSEGV, result.stderr
    assert active(daemon) == []


OOM_THEN_CHECKPOINT = (
    "echo 'RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB' >&2; exit 85"
)


def test_checkpoint_exit_passes_through_and_the_next_run_asks_for_as_much(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # checkpoint_exit_code = 85 (the manual's example). Before, an out-of-memory line in
    # the job's stderr made the checkpoint exit a failure to restart bigger on this node.
    daemon.start()
    calls = tmp_path / "chirp.log"
    remembered = tmp_path / "remembered"
    body = (
        f'if [ "$1" = get_job_attr ]; then cat {remembered} 2>/dev/null; exit 0; fi\n'
        f'echo "$@" >> {calls}'
    )
    env = fake_chirp(tmp_path, body)
    ad = AD + "SuccessCheckpointExitCode = 85\nWantFTOnCheckpoint = true\n"
    result, _ = wrapper(daemon, tmp_path, ad, "/bin/sh", "-c", OOM_THEN_CHECKPOINT, env=env)
    assert result.returncode == 85, result.stderr
    assert "restarting" not in result.stderr and "exited to checkpoint" in result.stderr
    [held] = [x for x in calls.read_text().splitlines() if "MigdPartitionMB" in x]
    size = int(held.split()[-1])
    assert f"set_job_attr MigdCheckpointVRAM {size}" in calls.read_text().splitlines()
    # The starter runs the wrapper again from the checkpoint, with the job ad of the claim
    # (RequestVRAM 4000); chirp has what the checkpoint exit wrote.
    remembered.write_text("19968\n")
    again, _ = wrapper(daemon, tmp_path, ad, "/bin/sh", "-c", "exit 0", env=env)
    assert again.returncode == 0, again.stderr
    assert "resuming from a checkpoint taken on a 19968 MiB partition" in again.stderr
    [lease_line] = [x for x in again.stderr.splitlines() if "[migd] lease " in x]
    granted = int(lease_line.split("(")[1].split()[0])
    assert granted >= 19968, lease_line
