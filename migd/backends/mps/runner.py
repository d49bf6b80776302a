"""How MPS control commands run: one bounded process each, possibly as another user.

:class:`CommandRunner` is the seam: the manager only ever calls ``run``, so tests can
see what would run, as whom, with which environment. :class:`SubprocessRunner` is the
real one.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from migd.errors import MpsError

from .errors import MpsBinaryNotFound, MpsCommandTimeout


@dataclass(frozen=True, slots=True)
class RunAs:
    """The user a daemon (and the commands sent to it) run as."""

    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + self.stderr).strip()


class CommandRunner(Protocol):
    """Runs one bounded command; the seam tests use to see what would run as whom."""

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: str | None,
        timeout_s: float,
        run_as: RunAs | None,
    ) -> CommandResult:
        """Run ``argv`` to completion.

        Raises:
            MpsBinaryNotFound: the program does not exist.
            MpsCommandTimeout: it ran longer than ``timeout_s`` (it is killed).
            MpsError: it could not be started (permissions, resources).
        """
        ...


class SubprocessRunner:
    """:class:`CommandRunner` over :func:`subprocess.run`.

    Output goes to temporary files, not pipes: ``-d`` leaves a daemon behind, and a
    daemon that kept an inherited pipe open would make the caller wait for it.
    ``run_as`` is honoured only when this process is root; otherwise the command runs
    as the current user (the caller records that).
    """

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdin: str | None,
        timeout_s: float,
        run_as: RunAs | None,
    ) -> CommandResult:
        user: dict[str, Any] = {}
        if run_as is not None and os.geteuid() == 0 and run_as.uid != 0:
            user = {"user": run_as.uid, "group": run_as.gid, "extra_groups": []}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.run(
                    list(argv),
                    input=None if stdin is None else stdin.encode(),
                    stdin=subprocess.DEVNULL if stdin is None else None,
                    stdout=out,
                    stderr=err,
                    env=dict(env),
                    timeout=timeout_s,
                    check=False,
                    close_fds=True,
                    **user,
                )
            except FileNotFoundError as exc:
                raise MpsBinaryNotFound(f"{argv[0]} not found", binary=argv[0]) from exc
            except subprocess.TimeoutExpired as exc:
                raise MpsCommandTimeout(
                    f"`{' '.join(argv)}` did not finish within {timeout_s:g} s",
                    argv=list(argv),
                    timeout_s=timeout_s,
                ) from exc
            except OSError as exc:
                raise MpsError(
                    f"cannot run `{' '.join(argv)}`: {exc}",
                    hint="check the binary's permissions and that migd runs as root",
                    argv=list(argv),
                ) from exc
            out.seek(0)
            err.seek(0)
            return CommandResult(
                argv=tuple(argv),
                returncode=proc.returncode,
                stdout=out.read().decode("utf-8", "replace"),
                stderr=err.read().decode("utf-8", "replace"),
            )
