"""The console entry points ``migd-wrapper`` and ``migd-run``, light on purpose.

HTCondor runs ``USER_JOB_WRAPPER`` for every job on the node, CPU-only jobs included, so
what the wrapper costs before it steps aside is paid by every job. This module decides
"no GPU requested" from the job ad's text with a few string operations and then
``exec``\\ s the job: the same pid, the job's own exit status and signals, as if migd were
not there. Its top level imports nothing but ``os`` and ``sys`` (already loaded by the
interpreter) and ``_signal`` (built in); pydantic, the HTCondor bindings, the client and
the supervising runner are imported only when the job asks for a GPU
(:mod:`migd.wrapper.main`). tests/unit/test_wrapper_entry.py holds it to that.

The decision is the one :func:`migd.wrapper.jobspec.spec_from_ads` makes (neither
``RequestGPUs`` > 0 nor ``RequestVRAM``: not a GPU job), taken here only where the ad
says so in plain literals. Whatever this parse is not sure of (an expression, a
repeated or oddly spelt attribute, no job id, an unreadable ad) goes to the full path,
which parses the ad with HTCondor's own bindings and decides as before.
"""

from __future__ import annotations

# _signal is built in (no file to find, no enum): ``signal`` would import enum (and
# functools, ...) for every CPU job, only to reset three dispositions.
import _signal
import os
import sys

JOB_AD_ENV = "_CONDOR_JOB_AD"
# The attributes the decision reads, lower-cased (ClassAd names are case-insensitive).
_WANTED = {
    "requestgpus": "RequestGPUs",
    "requestvram": "RequestVRAM",
    "globaljobid": "GlobalJobId",
    "clusterid": "ClusterId",
    "procid": "ProcId",
}
# Python ignores these at start-up and an exec keeps ignored signals ignored; a job
# started without migd has them at their defaults (subprocess restores the same three).
_RESTORED = ("SIGPIPE", "SIGXFZ", "SIGXFSZ")


def _plain_number(text: str) -> float | None:
    """``text`` as a number if it is a plain ClassAd integer or decimal literal, else None."""
    body = text[1:] if text[:1] in ("+", "-") else text
    whole, dot, fraction = body.partition(".")
    if not (whole.isascii() and whole.isdigit()) or (len(whole) > 1 and whole[0] == "0"):
        return None  # leading zeros: not what HTCondor writes, and the bindings balk at them
    if dot and not (fraction.isascii() and fraction.isdigit()):
        return None
    return float(text)


def no_gpu_requested(ad_text: str) -> bool:
    """True when the job ad plainly asks for no GPU: it has a job id, no ``RequestVRAM``
    and no ``RequestGPUs`` above 0, all as plain literals.

    False means "not sure", never "a GPU job": the caller then takes the full path.
    """
    found: dict[str, str] = {}
    for line in ad_text.splitlines():
        name, equals, value = line.partition("=")
        if not equals:
            continue
        key = name.strip()
        canonical = _WANTED.get(key.lower())
        if canonical is None:
            continue
        # A repeated attribute, or one spelt other than the full path reads it: not sure.
        if key != canonical or canonical in found:
            return False
        found[canonical] = value.strip()
    if "RequestVRAM" in found:
        return False
    if "RequestGPUs" in found:
        gpus = _plain_number(found["RequestGPUs"])
        if gpus is None or gpus > 0:
            return False
    global_id = found.get("GlobalJobId")
    if global_id is not None:
        # A plain string literal with something in it (escapes would need the real parser).
        inner = global_id[1:-1]
        return (
            len(global_id) >= 2
            and global_id[0] == global_id[-1] == '"'
            and '"' not in inner
            and "\\" not in inner
            and bool(inner.strip())
        )
    return found.get("ClusterId", "").isdigit() and found.get("ProcId", "").isdigit()


def exec_job(command: list[str]) -> int:
    """Replace this process with the job, with the signal dispositions a plain start gives it.

    Returns only when the job cannot be executed: 127 (not found) or 126, as a shell
    would (the job's own problem, which HTCondor must not retry as a migd failure).
    """
    for name in _RESTORED:
        signum = getattr(_signal, name, None)
        if signum is not None:
            _signal.signal(signum, _signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        print(
            f"[migd] cannot start the job {command[0]!r}: {exc.strerror or exc}; "
            f"exiting with {code}",
            file=sys.stderr,
            flush=True,
        )
        return code


def _read_job_ad() -> str | None:
    path = os.environ.get(JOB_AD_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as ad:  # noqa: PTH123 - no pathlib
            return ad.read()
    except OSError:
        return None  # the full path says why


def wrapper_main(argv: list[str] | None = None) -> int:
    """``migd-wrapper JOB_EXE [ARGS...]``: HTCondor's ``USER_JOB_WRAPPER``."""
    command = list(sys.argv[1:] if argv is None else argv)
    text = _read_job_ad() if command else None
    if text is not None and no_gpu_requested(text):
        return exec_job(command)
    from migd.wrapper.main import wrapper_main as full_wrapper_main

    return full_wrapper_main(command)


def run_main(argv: list[str] | None = None) -> int:
    """``migd-run --gpu-memory SIZE [options] -- CMD [ARGS...]`` (always a GPU job)."""
    from migd.wrapper.main import run_main as full_run_main

    return full_run_main(argv)
