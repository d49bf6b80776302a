"""``migd``: the daemon's command line (also ``python -m migd``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import structlog

from migd import __version__
from migd.daemon import exit_codes
from migd.daemon.config import DEFAULT_CONFIG_PATH, MigdConfig, example_toml, load_config
from migd.daemon.config_check import Findings, check_accounts, check_catalog, check_gpus
from migd.daemon.logs import configure_logging
from migd.errors import ConfigError, GeometryError, MigdError
from migd.ports import CgroupMemoryLimits, GpuEvents


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="migd",
        description="Node daemon that lets HTCondor jobs share NVIDIA GPUs (dynamic MIG + MPS).",
        epilog="Every config key can be set with --set section.key=value or MIGD_SECTION_KEY.",
    )
    parser.add_argument("--config", type=Path, help="TOML config (default /etc/migd/migd.toml)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set policy.queue=size (repeatable)",
    )
    parser.add_argument(
        "--simulate",
        metavar="NODE",
        help="use simulated GPUs: '8xA100-40GB', '2xA100-40GB,1xH100-80GB' or a node TOML file",
    )
    parser.add_argument("--state-dir", type=Path, help="daemon.state_dir")
    parser.add_argument("--runtime-dir", type=Path, help="daemon.runtime_dir")
    parser.add_argument("--socket", type=Path, help="api.socket")
    parser.add_argument("--log-format", choices=["auto", "json", "console"])
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="check the configuration (syntax, profile names, users and groups, the GPUs "
        "this node shows) and exit: 0 OK, 2 errors",
    )
    parser.add_argument(
        "--print-example-config", action="store_true", help="print a commented config and exit"
    )
    parser.add_argument("--version", action="version", version=f"migd {__version__}")
    return parser


# The named flags and the keys they set (error messages name the flag).
FLAG_KEYS = {
    "state_dir": "daemon.state_dir",
    "runtime_dir": "daemon.runtime_dir",
    "socket": "api.socket",
    "log_format": "daemon.log_format",
    "log_level": "daemon.log_level",
}


def flag_names(args: argparse.Namespace | None = None) -> dict[str, str]:
    """The flag that set each key, for error messages: with ``args``, only the flags
    given, so a key set with ``--set`` is named ``--set KEY`` (``--set
    daemon.log_level=loud`` was blamed on ``--log-level``, which was never used)."""
    names = {key: "--" + flag.replace("_", "-") for flag, key in FLAG_KEYS.items()}
    names |= {"backend.kind": "--simulate", "backend.simulate": "--simulate"}
    if args is None:
        return names
    given = {key for flag, key in FLAG_KEYS.items() if getattr(args, flag) is not None}
    if args.simulate:
        given |= {"backend.kind", "backend.simulate"}
    return {key: name for key, name in names.items() if key in given}


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    from migd.daemon.config import _coerce

    out: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set needs KEY=VALUE, got {item!r}", where="--set")
        out[key.strip()] = _coerce(value)
    if args.simulate:
        out["backend.kind"] = "simulated"
        out["backend.simulate"] = args.simulate
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            out[key] = str(value)
    return out


def simulated_node(config: MigdConfig, **options: Any) -> tuple[Any, Any]:
    """``simulated_backend`` for ``backend.simulate``.

    Raises:
        ConfigError: an unknown model or a malformed description (``backend.simulate``),
            a state file of other GPUs (``backend.sim_state_file``): exit 2.
    """
    from migd.backends.simulated import simulated_backend

    try:
        return simulated_backend(config.backend.simulate, **options)
    except GeometryError as exc:
        raise ConfigError(exc.message, where="backend.simulate", hint=exc.hint) from exc
    except ConfigError as exc:
        if exc.where == "backend.sim_state_file":
            raise
        # The description's own errors name a place inside it ("description: ..."):
        # say which setting holds it.
        raise ConfigError(exc.message, where="backend.simulate", hint=exc.hint) from exc


def build_ports(config: MigdConfig) -> tuple[Any, Any, Any]:
    """The backend, process table and (simulated) node for a configuration."""
    from migd.backends.procs import PsutilProcessTable

    if config.backend.kind == "simulated":
        options: dict[str, Any] = {
            "time_scale": config.backend.sim_time_scale,
            "destroy_retries": config.backend.destroy_retries,
        }
        if config.backend.sim_state_file is not None:
            options["state_file"] = config.backend.sim_state_file
        backend, node = simulated_node(config, **options)
        return backend, PsutilProcessTable(), node
    from migd.backends.nvml import NvmlBackend

    return NvmlBackend(destroy_retries=config.backend.destroy_retries), PsutilProcessTable(), None


def build_mps(config: MigdConfig) -> Any:
    """The MPS manager: one control daemon per MPS device under ``<runtime_dir>/mps``.

    On simulated nodes without NVIDIA's ``nvidia-cuda-mps-control`` the stand-in from
    ``migd.backends.simulated.mps_control`` is used, so MPS leases work in demos and tests.
    """
    import shutil

    from migd.backends.mps import MpsManager, MpsManagerConfig
    from migd.core.mps import UserPolicy

    binary = config.mps.control_binary
    if config.backend.kind == "simulated" and shutil.which(binary) is None:
        from migd.backends.simulated import write_fake_mps_control
        from migd.paths import ensure_dir

        runtime = config.daemon.runtime_dir  # checked, never through a symlink (paths.py)
        bin_dir = ensure_dir(runtime.parent, f"{runtime.name}/sim-bin", 0o755)
        binary = str(write_fake_mps_control(bin_dir))
    return MpsManager(
        config.daemon.runtime_dir,
        MpsManagerConfig(
            binary=binary,
            policy=UserPolicy.MULTI_USER if config.mps.multi_user else UserPolicy.PER_USER,
            idle_stop_s=config.mps.idle_stop_s,
        ),
    )


def build_events(config: MigdConfig, node: Any) -> GpuEvents | None:
    """NVML's event stream for the GPU health monitor: the simulated node's (with the XIDs
    ``health.sim_xids`` injects once it listens), or the real bindings' (None without)."""
    if node is not None:
        from migd.backends.simulated.nvml_events import SimGpuEvents

        return SimGpuEvents(node, config.health.sim_xids)
    if config.backend.kind == "simulated":
        return None
    from migd.backends.nvml.events import nvml_events

    return nvml_events()


def build_cgroup_limits(cgroup_root: Path, backend: Any, node: Any = None) -> CgroupMemoryLimits:
    """The MPS v3 port over the daemon's NVML backend (its initialised pynvml, at first
    use), or on a simulated node the stand-in NVML over that node (its driver version and
    MIG modes decide detection)."""
    from migd.backends.mps.dmem import NvmlCgroupLimits

    if node is not None:
        from migd.backends.simulated.dmem import SimDmemNvml

        return NvmlCgroupLimits(
            SimDmemNvml(node=node, cgroup_root=cgroup_root), cgroup_root=cgroup_root
        )
    return NvmlCgroupLimits(load=lambda: backend.nvml, cgroup_root=cgroup_root)


def print_config_error(exc: ConfigError) -> None:
    print(f"migd: configuration error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)


def _gpu_findings(config: MigdConfig) -> Findings:
    """:func:`check_gpus` against the GPUs this node shows (NVML, or ``--simulate``),
    or what was skipped and why where there is no GPU to ask."""
    try:
        if config.backend.kind == "simulated":
            # Without the state file: a check must not create or change it.
            backend, _ = simulated_node(config, time_scale=0.0)
        else:
            from migd.backends.nvml import NvmlBackend

            backend = NvmlBackend()
        gpus = backend.discover()
    except ConfigError as exc:
        return Findings(errors=[exc])
    except MigdError as exc:  # no driver, no bindings, no permission
        return Findings(
            skipped=[
                f"GPU checks ([[gpu]] match, each MIG GPU's profiles, policy.demand_prior): "
                f"no GPU to ask ({exc.message}); profile names were checked against the "
                "built-in catalog only"
            ]
        )
    try:
        return check_gpus(config, gpus, backend.geometry)
    finally:
        backend.close()


def _startd_findings(config: MigdConfig) -> Findings:
    """The startd's knobs that bypass migd, as warnings: they are HTCondor's
    configuration, not migd's (docs/operations.md, The startd's configuration)."""
    from migd.backends.condor import CondorConfigVal
    from migd.daemon.supervision.startd_check import check_startd_config

    if not config.htcondor.check_startd:
        return Findings()
    port = CondorConfigVal(tuple(config.htcondor.config_val_command))
    report = check_startd_config(port, config.htcondor, 0.0)
    if report.skipped is not None:
        return Findings(skipped=[f"the startd's configuration: {report.skipped}"])
    return Findings(
        warnings=[f"the startd bypasses migd: {f.line} (fix: {f.fix})" for f in report.findings]
    )


def check_config(config: MigdConfig, source: str) -> int:
    """``migd --check-config``: the values' meaning on this node (config_check.py)."""
    from migd.backends.accounts import SystemAccounts
    from migd.daemon.metrics.exporter import listen_warnings

    found = check_catalog(config)
    found.extend(check_accounts(config.api, SystemAccounts()))
    found.extend(_gpu_findings(config))
    found.extend(_startd_findings(config))
    for warning in [*listen_warnings(config), *found.warnings]:
        print(f"migd: warning: {warning}", file=sys.stderr)
    for skipped in found.skipped:
        print(f"migd: skipped: {skipped}", file=sys.stderr)
    for error in found.errors:
        print_config_error(error)
    if found.errors:
        print(f"configuration has {len(found.errors)} error(s) ({source})", file=sys.stderr)
        return exit_codes.CONFIG
    print(f"configuration OK ({source})")
    return exit_codes.OK


def check_at_start(config: MigdConfig, backend: Any, log: Any) -> None:
    """What --check-config checks, against the GPUs about to be managed.

    Raises:
        ConfigError: a profile name no model has, or one a MIG GPU lacks (every such
            GPU would otherwise start unhealthy). A ``[[gpu]] match`` without a GPU
            and an unknown account are logged only (config_check.py says why).
        DriverUnavailable: no NVIDIA driver.
    """
    from migd.backends.accounts import SystemAccounts

    found = check_catalog(config)
    if not found.errors:
        gpus = backend.discover()
        found.extend(check_gpus(config, gpus, backend.geometry, unmatched_is_error=False))
    errors = found.errors
    accounts = check_accounts(config.api, SystemAccounts())
    for problem in accounts.errors:
        log.warning("config.check", problem=problem.message, hint=problem.hint)
    for warning in found.warnings + accounts.warnings:
        log.warning("config.check", problem=warning)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigError(
            "; ".join(e.message for e in errors),
            hint="; ".join(dict.fromkeys(e.hint for e in errors if e.hint)),
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_example_config:
        sys.stdout.write(example_toml())
        return 0

    def load() -> MigdConfig:
        return load_config(
            args.config,
            overrides=overrides,
            required=args.config is not None,
            flag_names=flag_names(args),
        )

    try:
        overrides = overrides_from_args(args)
        config = load()
    except ConfigError as exc:
        print_config_error(exc)
        return exit_codes.CONFIG
    # Name the file that was read: load_config reads the default path when it exists,
    # so "defaults" is only true when there is no file.
    config_file = args.config or DEFAULT_CONFIG_PATH
    source = str(config_file) if config_file.exists() else f"defaults, no {config_file}"
    if args.check_config:
        return check_config(config, source)
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    log = structlog.get_logger("migd")
    log.info(
        "daemon.starting",
        version=__version__,
        python=sys.version.split()[0],
        config=source,
        pid=os.getpid(),
    )

    from migd.backends.accounts import SystemAccounts
    from migd.daemon.service import Daemon, lock_instance

    # Every error that stops the start is one log line (what happened, what to do) and an
    # exit status systemd acts on (exit_codes.py): no traceback.
    try:
        # First: a second migd must not touch the state, the runtime directory (MPS
        # stand-in, state file) or the socket of the one running (paths.InstanceLock).
        lock = lock_instance(config)
    except MigdError as exc:
        log.error("daemon.start_failed", error=exc.code, message=exc.message, hint=exc.hint)
        return exit_codes.exit_status(exc)
    backend: Any = None
    try:
        backend, procs, node = build_ports(config)
        check_at_start(config, backend, log)
        mps = build_mps(config)
    except MigdError as exc:
        log.error("daemon.start_failed", error=exc.code, message=exc.message, hint=exc.hint)
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.close()
        lock.release()
        return exit_codes.exit_status(exc)

    if node is not None:
        # On the simulated GPU an MPS server is an NVML compute process, as on hardware.
        mps.watch_servers(node.procs.track_mps_servers)

    startd = None
    if config.htcondor.offline_gpus:
        from migd.backends.condor import StartdOffline

        startd = StartdOffline(
            config.htcondor.offline_path(config.daemon.runtime_dir),
            reconfig=tuple(config.htcondor.reconfig_command),
            config_val=tuple(config.htcondor.shares_command),
        )

    startd_config = None
    if config.htcondor.check_startd:  # [htcondor] changes need a restart (RESTART_KEYS)
        from migd.backends.condor import CondorConfigVal

        startd_config = CondorConfigVal(tuple(config.htcondor.config_val_command))

    async def run() -> int:
        daemon = Daemon(
            config,
            backend,
            procs,
            reload_config=load,
            events=build_events(config, node),
            mps=mps,
            cgroup_limits=build_cgroup_limits(config.mps.cgroup_root, backend, node),
            accounts=SystemAccounts(),
            startd=startd,
            lock=lock,
            startd_config=startd_config,
        )
        if node is not None:
            from migd.daemon.api.sim_ops import SimOps

            SimOps(node, daemon.ctx).register(daemon.api)  # fake CUDA jobs, XID injection
        return await daemon.run()

    try:
        return asyncio.run(run())
    except KeyboardInterrupt:  # pragma: no cover - signal handlers cover this
        return 130
    except (OSError, MigdError) as exc:
        log.error("daemon.failed", error=str(exc))
        return exit_codes.exit_status(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
