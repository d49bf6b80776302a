"""HTCondor boundary: read job/machine ads, update the job's request through chirp, and
tell the node's startd which GPUs are out of service.

The only module that imports the HTCondor Python bindings (``classad2``,
``htcondor2.htchirp``), lazily, so the daemon never loads them; the daemon uses only
:class:`StartdOffline`, which runs HTCondor's command-line tools.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migd.core.condor_shares import FALLBACK_SHARES, offline_share_ids
from migd.errors import ChirpError, JobAdError, StartdError

CHIRP_CANDIDATES = (
    "/usr/lib/condor/libexec/condor_chirp",  # Debian/Ubuntu packages
    "/usr/libexec/condor/condor_chirp",  # RPM packages
)


def read_ad(path: str | Path, what: str = "job ad") -> dict[str, Any]:
    """Parse an HTCondor ad file (``$_CONDOR_JOB_AD``, ``$_CONDOR_MACHINE_AD``) to plain values.

    Expressions are evaluated in the ad's own scope; attributes that do not evaluate
    to a literal (references to the other ad, undefined) are left out.

    Raises:
        JobAdError: the file is missing, unreadable or not an ad.
    """
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise JobAdError(f"cannot read the {what} {path}: {exc.strerror}") from exc
    if not text.strip():
        raise JobAdError(f"the {what} {path} is empty")
    try:
        import classad2
    except ImportError as exc:  # pragma: no cover - htcondor is a core dependency
        raise JobAdError(
            "the HTCondor Python bindings (htcondor package) are not installed",
            hint="pip install htcondor",
        ) from exc
    try:
        ad = classad2.parseOne(text)
    except Exception as exc:  # classad2 raises plain ValueError/ClassAdException
        raise JobAdError(f"the {what} {path} is not a ClassAd: {exc}") from exc
    out: dict[str, Any] = {}
    for key in ad:
        try:
            value = ad.eval(key)
        except Exception:
            continue
        if isinstance(value, str | int | float | bool):
            out[str(key)] = value
    return out


def chirp_value(value: str | int | bool) -> str:
    """A ClassAd literal for ``condor_chirp set_job_attr`` (strings are quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def set_job_attrs(attrs: Mapping[str, str | int | bool], *, timeout_s: float = 30.0) -> str:
    """``condor_chirp set_job_attr NAME VALUE`` for each attribute (needs ``WantIOProxy``).

    Tries the Python chirp client first (one connection for all), then the
    ``condor_chirp`` binary. Never raises anything but :class:`ChirpError`: a hung
    or missing chirp must not take the wrapper down with it.

    Returns:
        How it was done, for the log.

    Raises:
        ChirpError: chirp is not available, timed out, or the schedd refused the update.
    """
    texts = {name: chirp_value(value) for name, value in attrs.items()}
    first_error: Exception | None = None
    if os.environ.get("_CONDOR_CHIRP_CONFIG"):
        try:
            from htcondor2 import htchirp

            with htchirp.HTChirp() as chirp:
                for name, text in texts.items():
                    chirp.set_job_attr(name, text)
            return "htchirp"
        except Exception as exc:  # the bindings raise plain OSError/RuntimeError/...
            first_error = exc
    binary = shutil.which("condor_chirp") or next(
        (c for c in CHIRP_CANDIDATES if Path(c).exists()), None
    )
    names = ", ".join(texts)
    if binary is None:
        raise ChirpError(
            f"cannot update {names}: no chirp ({first_error or 'no _CONDOR_CHIRP_CONFIG'})",
            hint="submit with `+WantIOProxy = true` so the job can update its request",
        )
    for name, text in texts.items():
        try:
            rc, _, stderr = _run_tool([binary, "set_job_attr", name, text], timeout_s)
        except OSError as exc:
            raise ChirpError(f"cannot run {binary}: {exc.strerror or exc}") from exc
        except subprocess.TimeoutExpired as exc:
            raise ChirpError(
                f"condor_chirp set_job_attr {name} did not answer within {timeout_s:g} s",
                hint="the starter or shadow is busy or gone; HTCondor keeps the old value",
            ) from exc
        if rc != 0:
            why = stderr.strip() or f"exit {rc}"
            raise ChirpError(
                f"condor_chirp set_job_attr {name} failed: {why}",
                hint="submit with `+WantIOProxy = true`",
            )
    return binary


def get_job_attr(name: str, *, timeout_s: float = 30.0) -> str | None:
    """``condor_chirp get_job_attr NAME``: the attribute as the shadow has it now (what
    an earlier run of this job chirped), as ClassAd text; ``None`` when undefined.

    Raises:
        ChirpError: chirp is not available, timed out or failed.
    """
    first_error: Exception | None = None
    if os.environ.get("_CONDOR_CHIRP_CONFIG"):
        try:
            from htcondor2 import htchirp

            with htchirp.HTChirp() as chirp:
                value = chirp.get_job_attr(name)
            return _defined(str(value))
        except Exception as exc:  # the bindings raise plain OSError/RuntimeError/...
            first_error = exc
    binary = shutil.which("condor_chirp") or next(
        (c for c in CHIRP_CANDIDATES if Path(c).exists()), None
    )
    if binary is None:
        raise ChirpError(
            f"cannot read {name}: no chirp ({first_error or 'no _CONDOR_CHIRP_CONFIG'})",
            hint="submit with `+WantIOProxy = true`",
        )
    try:
        rc, stdout, stderr = _run_tool([binary, "get_job_attr", name], timeout_s)
    except OSError as exc:
        raise ChirpError(f"cannot run {binary}: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ChirpError(
            f"condor_chirp get_job_attr {name} did not answer within {timeout_s:g} s"
        ) from exc
    if rc != 0:
        raise ChirpError(f"condor_chirp get_job_attr {name} failed: {stderr.strip() or rc}")
    return _defined(stdout)


def _defined(text: str) -> str | None:
    value = text.strip()
    return None if value in ("", "UNDEFINED", "undefined") else value


OFFLINE_FILE_HEADER = """\
# Written by migd: the HTCondor GPU IDs of the GPUs migd has taken out of service (a
# health condition such as an XID, or `migctl drain`). The shipped 10-migd-execute.config
# includes this file; migd rewrites it and runs condor_reconfig when a GPU's health
# changes. Do not edit: `migctl drain GPU` / `migctl resume GPU` change what it says.
"""


@dataclass
class StartdOffline:
    """:class:`migd.ports.StartdControl` through a config file and ``condor_reconfig``.

    The file holds ``OFFLINE_MACHINE_RESOURCE_GPUs`` for every share of the given GPUs
    (``MIGD_SHARES_PER_GPU`` of them, as ``condor_config_val`` reads HTCondor's
    configuration; :data:`~migd.core.condor_shares.FALLBACK_SHARES` when it cannot),
    appended to whatever the configuration read before it set.
    """

    path: Path
    reconfig: Sequence[str] = ("condor_reconfig", "-daemon", "startd")
    config_val: Sequence[str] = ("condor_config_val", "MIGD_SHARES_PER_GPU")
    timeout_s: float = 30.0
    #: The file changed but the startd was not told (a failed reconfig): the next call
    #: reconfigures even when the file already says what it wants.
    reconfig_owed: bool = False

    def shares_per_gpu(self) -> int:
        try:
            out = _run(self.config_val, self.timeout_s)
            return max(1, int(out.strip()))
        except (StartdError, ValueError):
            return FALLBACK_SHARES

    def render(self, ids: Sequence[str]) -> str:
        if not ids:
            return OFFLINE_FILE_HEADER
        return (
            OFFLINE_FILE_HEADER
            + "OFFLINE_MACHINE_RESOURCE_GPUs = $(OFFLINE_MACHINE_RESOURCE_GPUs) "
            + ", ".join(ids)
            + "\n"
        )

    def set_offline_gpus(self, uuids: Sequence[str]) -> list[str]:
        ids = offline_share_ids(uuids, self.shares_per_gpu()) if uuids else []
        text = self.render(ids)
        try:
            old: str | None = self.path.read_text()
        except FileNotFoundError:
            old = None
        except OSError as exc:
            raise StartdError(f"cannot read {self.path}: {exc.strerror or exc}") from exc
        # Unchanged (or nothing offline and no file): the startd reads the file when it
        # starts and has read it at the last reconfig, so there is nothing to tell it.
        if (old == text or (old is None and not ids)) and not self.reconfig_owed:
            return ids
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text(text)
            tmp.chmod(0o644)  # HTCondor's tools read the configuration as any user
            tmp.replace(self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StartdError(f"cannot write {self.path}: {exc.strerror or exc}") from exc
        self.reconfig_owed = True
        _run(self.reconfig, self.timeout_s)
        self.reconfig_owed = False
        return ids


def run_tool(command: Sequence[str], timeout_s: float = 120.0) -> str:
    """Run one of HTCondor's tools (``condor_status``, ``condor_reconfig``) for a migctl
    command; its stdout, or :class:`StartdError` saying what failed."""
    return _run(command, timeout_s)


@dataclass
class CondorConfigVal:
    """:class:`migd.ports.StartdConfig` through ``condor_config_val``.

    ``-subsystem startd`` reads the configuration as the startd does (``STARTD.START``
    wins over ``START``); the value comes with its macros expanded. An undefined knob
    makes the tool exit 1 with ``Not defined: NAME`` (HTCondor 23.9): that is None here,
    not an error.
    """

    command: Sequence[str] = ("condor_config_val", "-subsystem", "startd")
    timeout_s: float = 10.0

    def value(self, name: str) -> str | None:
        argv = [*self.command, name]
        shown = " ".join(argv)
        try:
            rc, out, err = _run_tool(argv, self.timeout_s)
        except OSError as exc:
            raise StartdError(
                f"cannot run {shown}: {exc.strerror or exc}",
                hint="install HTCondor on this node, or set [htcondor] check_startd = false "
                "where no startd runs (docs/operations.md, The startd's configuration)",
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise StartdError(f"{shown} did not finish within {self.timeout_s:g} s") from exc
        if rc == 0:
            return out.strip()
        if "not defined" in err.lower():
            return None
        why = (err.strip() or out.strip() or f"exit {rc}").splitlines()[-1]
        raise StartdError(f"{shown} failed: {why}")


def _run(command: Sequence[str], timeout_s: float) -> str:
    """Run one of HTCondor's tools; its stdout, or :class:`StartdError` with its stderr."""
    shown = " ".join(command)
    try:
        rc, out, err = _run_tool(command, timeout_s)
    except OSError as exc:
        raise StartdError(f"cannot run {shown}: {exc.strerror or exc}") from exc
    except subprocess.TimeoutExpired as exc:
        raise StartdError(f"{shown} did not finish within {timeout_s:g} s") from exc
    if rc != 0:
        why = (err.strip() or out.strip() or f"exit {rc}").splitlines()[-1]
        raise StartdError(f"{shown} failed: {why}")
    return out


def _run_tool(command: Sequence[str], timeout_s: float) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of an HTCondor tool that must not hang its caller.

    Raises:
        OSError: it could not be started.
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (it and everything it
            started are killed first).
    """
    # Its own session, so a tool that hangs goes with everything it started.
    proc = subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, out, err
