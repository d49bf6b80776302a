"""The console entry points ``migd-wrapper`` and ``migd-run``, light on purpose.

HTCondor runs ``USER_JOB_WRAPPER`` for every job on the node, CPU-only jobs included, so
what the wrapper costs before it steps aside is paid by every job. This module decides
"no GPU requested" from the job ad's text with a few string operations and then
``exec``\\ s the job: the same pid, the job's own exit status and signals, as if migd were
not there. Its top level imports only modules the interpreter has loaded before it runs
(``os``, ``sys``, ``_signal``, ``_collections_abc``); pydantic, the HTCondor bindings,
the client and the supervising runner are imported only when the job asks for a GPU
(:mod:`migd.wrapper.main`). tests/unit/test_wrapper_entry.py holds it to that.

The decision is the one :func:`migd.wrapper.jobspec.spec_from_ads` makes (neither
``RequestGPUs`` > 0 nor ``RequestVRAM``: not a GPU job), taken here only where the ad
says so in plain literals (:class:`PlainAd`, which the GPU path uses too). Whatever it
is not sure of (an expression, a repeated or oddly spelt attribute, no job id, an
unreadable ad) goes to the full path, which parses the ad with HTCondor's own bindings
and decides as before.
"""

from __future__ import annotations

# _signal is built in (no file to find, no enum): ``signal`` would import enum (and
# functools, ...) for every CPU job, only to reset three dispositions.
import _signal
import os
import sys

# Loaded by the interpreter at start-up (collections.abc would import collections, and
# typing is not loaded at all).
from _collections_abc import Iterator, Mapping

JOB_AD_ENV = "_CONDOR_JOB_AD"
# Python ignores these at start-up and an exec keeps ignored signals ignored; a job
# started without migd has them at their defaults (subprocess restores the same three).
_RESTORED = ("SIGPIPE", "SIGXFZ", "SIGXFSZ")
# ClassAd integers are 64-bit; longer digit strings are left to the bindings.
_MAX_DIGITS = 18


class NeedBindings(Exception):
    """An attribute this parse cannot read as HTCondor's bindings would: use them."""


def _literal(raw: str) -> str | int | float | bool:
    """A plain ClassAd literal as the bindings evaluate it.

    Raises:
        NeedBindings: anything else (an expression, an escape, an unusual spelling).
    """
    if len(raw) >= 2 and raw[0] == raw[-1] == '"':
        inner = raw[1:-1]
        if '"' in inner or "\\" in inner:
            raise NeedBindings(raw)
        return inner
    if raw in ("true", "false"):
        return raw == "true"
    whole, dot, fraction = raw.removeprefix("-").partition(".")
    # No leading zeros: not what HTCondor writes, and the bindings balk at some of them.
    if whole.isascii() and whole.isdigit() and (len(whole) == 1 or whole[0] != "0"):
        if not dot and len(whole) <= _MAX_DIGITS:
            return int(raw)
        if dot and fraction.isascii() and fraction.isdigit():
            return float(raw)
    raise NeedBindings(raw)


class PlainAd(Mapping[str, object]):
    """An ad in HTCondor's text form (one ``Name = value`` per line), read without the
    bindings for whatever is a plain literal.

    It answers like the dict ``migd.backends.condor.read_ad`` returns, for the attributes
    it can vouch for; where it cannot (the value is an expression or an escaped string,
    the attribute is repeated or spelt in another case, or the whole ad is enumerated),
    it raises :class:`NeedBindings`, so a reader that gets an answer got the bindings'.
    """

    def __init__(self, text: str) -> None:
        self._lines: dict[str, list[tuple[str, str]]] = {}
        for line in text.splitlines():
            name, equals, value = line.partition("=")
            if equals:
                key = name.strip()
                self._lines.setdefault(key.lower(), []).append((key, value.strip()))

    def __getitem__(self, key: str) -> object:
        found = self._lines.get(key.lower())
        if not found:
            raise KeyError(key)
        if len(found) > 1 or found[0][0] != key:
            raise NeedBindings(key)
        return _literal(found[0][1])

    def __iter__(self) -> Iterator[str]:
        raise NeedBindings("every attribute")

    def __len__(self) -> int:
        raise NeedBindings("every attribute")

    def __bool__(self) -> bool:
        # read_ad's dict is empty when no attribute evaluates to a literal; where that
        # differs from "no lines", reading any attribute raises NeedBindings anyway.
        return bool(self._lines)


def no_gpu_requested(ad_text: str) -> bool:
    """True when the job ad plainly asks for no GPU: a job id, no ``RequestVRAM`` and no
    ``RequestGPUs`` above 0, all plain literals (the decision of ``spec_from_ads``).

    False means "not sure", never "a GPU job": the caller then takes the full path.
    """
    ad = PlainAd(ad_text)
    try:
        if ad.get("RequestVRAM") is not None:
            return False
        gpus = ad.get("RequestGPUs", 0)
        if isinstance(gpus, bool) or not isinstance(gpus, int | float) or gpus > 0:
            return False
        global_id = ad.get("GlobalJobId")
        if isinstance(global_id, str) and global_id.strip():
            return True
        cluster, proc = ad.get("ClusterId"), ad.get("ProcId")
    except NeedBindings:
        return False
    return all(isinstance(x, int) and not isinstance(x, bool) for x in (cluster, proc))


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
