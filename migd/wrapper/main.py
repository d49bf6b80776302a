"""Entry points: ``migd-wrapper`` (HTCondor's USER_JOB_WRAPPER) and ``migd-run``.

``migd-wrapper JOB_EXE [ARGS...]``: HTCondor runs it as the job's user with the
job's environment; the request comes from ``$_CONDOR_JOB_AD`` and
``$_CONDOR_MACHINE_AD``. When migd cannot serve the job, the reason goes to
``$_CONDOR_WRAPPER_ERROR_FILE`` (HTCondor shows it and puts the job back).

``migd-run --gpu-memory 10G [options] -- CMD [ARGS...]``: the same outside HTCondor.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from migd.client import MigdClient
from migd.errors import ConfigError, JobAdError, MigdError
from migd.wrapper.entry import NeedBindings, PlainAd, exec_job
from migd.wrapper.exit_status import JobEnd, record_for_starter
from migd.wrapper.jobspec import JobSpec, spec_from_ads, spec_from_flags
from migd.wrapper.leasing import WrapperFailure
from migd.wrapper.runner import JobRunner, StopRequested
from migd.wrapper.settings import load_settings

if TYPE_CHECKING:
    import argparse

WRAPPER_ERROR_ENV = "_CONDOR_WRAPPER_ERROR_FILE"


def _fail(message: str, exit_code: int = 1, command: Sequence[str] = ()) -> int:
    """Say why on stderr and, under HTCondor, in the wrapper error file (one line)."""
    record_for_starter(JobEnd(exit_code=exit_code), command)  # under condor_pid_ns_init
    line = " ".join(message.split())
    print(f"[migd] {line}", file=sys.stderr, flush=True)
    path = os.environ.get(WRAPPER_ERROR_ENV)
    if path and exit_code != 86:
        try:
            Path(path).write_text(line + "\n")
            # HTCondor 23.x's starter checks the file as user `condor`, which cannot enter
            # the 0700 sandbox: without this the error is silently ignored
            # (docs/htcondor-notes.md, answer (c)).
            scratch = os.environ.get("_CONDOR_SCRATCH_DIR")
            if scratch:
                Path(scratch).chmod(0o711)
        except OSError as exc:
            print(f"[migd] cannot write {path}: {exc}", file=sys.stderr)
    return exit_code


def _run(spec: JobSpec, socket_path: str | None, notes: list[str] | None = None) -> int:
    if not spec.gpu_job:
        # Not a GPU job: the wrapper steps aside (USER_JOB_WRAPPER wraps every job). Most
        # get here without this module (migd.wrapper.entry); an ad that entry's parse
        # was not sure of comes this way.
        return exec_job(list(spec.command))
    from migd.backends.condor import get_job_attr, set_job_attrs

    try:
        settings = load_settings()
    except ConfigError as exc:
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        return _fail(f"migd-wrapper: bad setting: {exc.message}{hint}", command=spec.command)
    runner = JobRunner(
        spec,
        MigdClient(socket_path, timeout_s=30.0),
        settings=settings,
        set_job_attrs=functools.partial(set_job_attrs, timeout_s=settings.section.chirp_timeout_s),
        get_job_attr=functools.partial(get_job_attr, timeout_s=settings.section.chirp_timeout_s),
    )
    for note in [*(notes or []), *settings.notes]:
        runner.debug(note)
    if settings.sources:
        runner.debug(f"settings from {', '.join(settings.sources)}")
    try:
        code = runner.run()
        # Under condor_pid_ns_init the starter reads the job's end from its status file,
        # not from our exit: where the code is ours (86, 127) it must say so.
        record_for_starter(JobEnd(exit_code=code), spec.command)
        return code
    except WrapperFailure as exc:
        return _fail(exc.message, exc.exit_code, spec.command)
    except StopRequested as exc:
        print(f"[migd] stopped by {exc} before the job started", file=sys.stderr, flush=True)
        runner.reraise(exc.signum)  # so HTCondor sees the signal, as it would from the job
        return 128 + exc.signum  # pragma: no cover - reraise does not return


def _plain_ad(path: str) -> PlainAd:
    """The ad at ``path`` for reading without the bindings (NeedBindings: read_ad says
    what is wrong with a missing, unreadable or empty file)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as exc:
        raise NeedBindings(path) from exc
    if not text.strip():
        raise NeedBindings(path)
    return PlainAd(text)


def wrapper_main(argv: list[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    job_ad_path = os.environ.get("_CONDOR_JOB_AD")
    if not job_ad_path:
        return _fail(
            "migd-wrapper: no $_CONDOR_JOB_AD; it runs as HTCondor's USER_JOB_WRAPPER "
            "(outside HTCondor use `migd-run --gpu-memory SIZE -- cmd`)",
            2,
        )
    notes = []
    machine_path = os.environ.get("_CONDOR_MACHINE_AD")
    if not machine_path:
        # Documented: without it there is no slot name, VRAM fallback or GPU pinning.
        notes.append("no $_CONDOR_MACHINE_AD: no slot name, VRAM fallback or GPU pinning")
    try:
        try:
            # What the wrapper reads is nearly always a plain literal: read it without
            # loading HTCondor's bindings; anything else (NeedBindings), with them.
            spec = spec_from_ads(
                command, _plain_ad(job_ad_path), _plain_ad(machine_path) if machine_path else None
            )
        except NeedBindings:
            from migd.backends.condor import read_ad

            job_ad = read_ad(job_ad_path, "job ad")
            machine_ad = read_ad(machine_path, "machine ad") if machine_path else None
            spec = spec_from_ads(command, job_ad, machine_ad)
    except JobAdError as exc:
        return _fail(
            f"migd-wrapper: {exc.message}" + (f" (hint: {exc.hint})" if exc.hint else ""),
            command=command,
        )
    return _run(spec, os.environ.get("MIGD_API_SOCKET"), notes)


def build_run_parser() -> argparse.ArgumentParser:
    """migd-run's flags (also the source of its man page: packaging/manpage.py)."""
    # Here, not at the top: migd-wrapper (every HTCondor GPU job) parses no flags.
    import argparse

    parser = argparse.ArgumentParser(
        prog="migd-run",
        description="Run a command on a right-sized GPU partition from migd.",
        usage="migd-run --gpu-memory SIZE [options] -- CMD [ARGS...]",
    )
    parser.add_argument("--gpu-memory", required=True, help="e.g. 10G, 512M, 20480 (MiB)")
    parser.add_argument("--mode", default="auto", choices=["auto", "mig", "mps"])
    parser.add_argument("--min-compute", type=int, default=0, help="minimum MIG compute slices")
    parser.add_argument("--gpu", action="append", default=None, help="restrict to this GPU")
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        metavar="N",
        help="partitions on N GPUs, all or none, each of --gpu-memory (with N --gpu: one each)",
    )
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--early-restart", action="store_true", help="use the memory forecast")
    parser.add_argument("--horizon", type=float, default=None, help="total iterations or seconds")
    parser.add_argument("--growth-factor", type=float, default=0.0)
    parser.add_argument("--wait", type=float, default=None, help="seconds to wait for a partition")
    parser.add_argument("--job-id", default=None, help="name shown by migctl (default: host:pid)")
    parser.add_argument("--socket", default=None, help="migd's socket")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def run_main(argv: list[str] | None = None) -> int:
    import socket

    parser = build_run_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        spec = spec_from_flags(
            command,
            gpu_memory=args.gpu_memory,
            job_id=args.job_id or f"{socket.gethostname()}:{os.getpid()}",
            mode=args.mode,
            min_compute=args.min_compute,
            gpus=args.gpu,
            gpu_count=args.gpus,
            max_restarts=args.max_restarts,
            early_restart=args.early_restart,
            horizon=args.horizon,
            growth_factor=args.growth_factor,
            wait_s=args.wait,
        )
    except MigdError as exc:
        print(
            f"migd-run: {exc.message}" + (f" (hint: {exc.hint})" if exc.hint else ""),
            file=sys.stderr,
        )
        return 2
    return _run(spec, args.socket)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_main())
