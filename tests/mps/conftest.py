"""Fixtures for the MPS tests: the fake control binary, short runtime dirs, managers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from migd.backends.mps import (
    CommandResult,
    MpsManager,
    MpsManagerConfig,
    RunAs,
    SubprocessRunner,
)
from migd.backends.simulated import write_fake_mps_control
from migd.backends.simulated.mps_control import PID_FILE_NAME
from migd.ports import ManualClock
from tests.waiting import limit


@pytest.fixture(scope="session")
def fake_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_mps_control(tmp_path_factory.mktemp("bin"))


def _fake_pids_under(root: Path) -> list[int]:
    pids = []
    for pid_file in root.rglob(PID_FILE_NAME):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pid_file.read_text().strip()))
    return pids


def kill_fake(pid: int) -> None:
    """Kill one fake daemon this test session started (checked by its command line)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"fake_mps_control" in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A runtime dir with a short path: the control socket path must stay under 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="migd-", dir="/tmp"))
    path.chmod(0o755)
    started: list[int] = []
    yield path
    # Whatever daemons a test left behind (it failed half-way): kill them by pid.
    started.extend(_fake_pids_under(path))
    for pid in started:
        kill_fake(pid)
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class RecordingRunner:
    """Runs commands for real (as this user) and records who they were meant to run as."""

    inner: SubprocessRunner = field(default_factory=SubprocessRunner)
    calls: list[tuple[tuple[str, ...], str | None, RunAs | None]] = field(default_factory=list)

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: str | None,
        timeout_s: float,
        run_as: RunAs | None,
    ) -> CommandResult:
        self.calls.append((tuple(argv), stdin, run_as))
        # The fake cannot run as another user here (the interpreter lives under /root).
        return self.inner.run(argv, env=env, stdin=stdin, timeout_s=timeout_s, run_as=None)

    def daemon_starts(self) -> list[tuple[tuple[str, ...], RunAs | None]]:
        return [(argv, run_as) for argv, _stdin, run_as in self.calls if "-d" in argv]


@dataclass
class Env:
    runtime_dir: Path
    binary: Path
    clock: ManualClock
    runner: RecordingRunner
    managers: list[MpsManager] = field(default_factory=list)

    def manager(self, **config: object) -> MpsManager:
        settings: dict[str, object] = {
            "binary": str(self.binary),
            "idle_stop_s": 60.0,
            # A command to the stand-in daemon is a Python start on a loaded 2-core host: it
            # took over 3 s at load 15. Tests of a hung daemon set their own, shorter limit.
            "command_timeout_s": limit(30.0),
            "start_timeout_s": limit(60.0),
            "quit_timeout_s": limit(30.0),
        }
        settings.update(config)
        manager = MpsManager(
            self.runtime_dir,
            MpsManagerConfig(**settings),  # type: ignore[arg-type]
            runner=self.runner,
            clock=self.clock,
        )
        self.managers.append(manager)
        return manager

    def control(self, pipe_dir: str | Path, *commands: str, timeout_s: float = 30.0) -> str:
        """Talk to a daemon like a person would: ``echo cmd | nvidia-cuda-mps-control``."""
        proc = subprocess.run(
            [str(self.binary)],
            input="".join(c + "\n" for c in commands),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)},
            check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout


@pytest.fixture
def env(short_dir: Path, fake_binary: Path) -> Iterator[Env]:
    environment = Env(
        runtime_dir=short_dir, binary=fake_binary, clock=ManualClock(), runner=RecordingRunner()
    )
    yield environment
    for manager in environment.managers:
        with contextlib.suppress(Exception):
            manager.shutdown()


@pytest.fixture
def client_procs() -> Iterator[Callable[[], int]]:
    """Real processes to register as MPS clients (the fake drops clients that exit)."""
    procs: list[subprocess.Popen[bytes]] = []

    def spawn() -> int:
        proc = subprocess.Popen(["sleep", "300"])
        procs.append(proc)
        return proc.pid

    yield spawn
    for proc in procs:
        proc.kill()
        proc.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"
