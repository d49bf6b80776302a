"""HTCondor boundary: read job/machine ads, update the job's request through chirp.

The only module that imports the HTCondor Python bindings (``classad2``,
``htcondor2.htchirp``), lazily, so the daemon never loads them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from migd.errors import ChirpError, JobAdError

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
            # Its own session, so a chirp that hangs goes with everything it started.
            proc = subprocess.Popen(
                [binary, "set_job_attr", name, text],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        except OSError as exc:
            raise ChirpError(f"cannot run {binary}: {exc.strerror or exc}") from exc
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ChirpError(
                f"condor_chirp set_job_attr {name} did not answer within {timeout_s:g} s",
                hint="the starter or shadow is busy or gone; HTCondor keeps the old value",
            ) from exc
        if proc.returncode != 0:
            why = stderr.strip() or f"exit {proc.returncode}"
            raise ChirpError(
                f"condor_chirp set_job_attr {name} failed: {why}",
                hint="submit with `+WantIOProxy = true`",
            )
    return binary
