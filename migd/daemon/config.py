"""migd's configuration: a versioned TOML file validated by pydantic.

Precedence, lowest first: built-in defaults, the file (``/etc/migd/migd.toml``
unless ``--config``), ``MIGD_<SECTION>_<KEY>`` environment variables, then
command-line flags (``--set section.key=value`` reaches every key; common keys
have their own flags). Every key is documented in ``docs/configuration.md``
and in the file ``migd --print-example-config`` prints.

Errors name the exact place: ``policy.queue: Input should be 'fifo' or 'size'``.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from migd.core.planner import GpuChoice, PlacementRule
from migd.core.queueing import QueuePolicy
from migd.errors import ConfigError
from migd.wrapper_section import WrapperSection

DEFAULT_CONFIG_PATH = Path("/etc/migd/migd.toml")
ENV_PREFIX = "MIGD_"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaemonSection(_Section):
    state_dir: Path = Path("/var/lib/migd")
    runtime_dir: Path = Path("/run/migd")
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    work_timeout_s: float = Field(
        120.0, gt=0, description="longest one NVML create/destroy may take"
    )
    shutdown_grace_s: float = Field(30.0, ge=0)
    history_keep: int = Field(100_000, ge=100, description="history rows kept in the state db")
    history_keep_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        description="bytes of history event data kept in the state db (oldest pruned first)",
    )


class BackendSection(_Section):
    kind: Literal["nvml", "simulated"] = "nvml"
    simulate: str = Field(
        "8xA100-40GB",
        description="node description for kind=simulated: '8xA100-40GB', '2xA100-40GB,1xH100-80GB' "
        "or a path to a TOML node file",
    )
    sim_time_scale: float = Field(
        1.0,
        ge=0,
        description="kind=simulated: 1.0 = real NVML create/destroy latencies "
        "([Villarrubia] Table 1, or the node description's latency tables); "
        "0 = instant (tests, benchmarks)",
    )
    sim_state_file: Path | None = Field(
        None,
        description="kind=simulated: keep the simulated GPUs' state in this file so it survives "
        "a daemon restart, as real GPUs do",
    )
    destroy_retries: int = Field(3, ge=0)


class ApiSection(_Section):
    socket: Path = Path("/run/migd/migd.sock")
    lease_users: list[str] = Field(default_factory=lambda: ["root", "condor"])
    lease_groups: list[str] = Field(default_factory=lambda: ["condor"])
    admin_users: list[str] = Field(default_factory=lambda: ["root"])
    admin_groups: list[str] = Field(default_factory=list)
    hook_users: list[str] = Field(
        default_factory=lambda: ["condor"],
        description="may release any job's leases (release_job) besides admins",
    )
    status_public: bool = True
    socket_group: str | None = Field(
        None,
        description="group of the socket file when it is 0660 (status_public = false and "
        "no lease_users '*'): the group the lease users share",
    )
    max_message_bytes: int = Field(65536, ge=1024, le=16 * 1024 * 1024)
    max_clients: int = Field(512, ge=1)
    max_clients_per_uid: int = Field(
        64, ge=1, description="open connections one uid may hold (root: no limit)"
    )
    request_timeout_s: float = Field(
        10.0, gt=0, description="a client must send its request line within this time"
    )
    send_timeout_s: float = Field(
        10.0, gt=0, description="a client that does not read its reply within this is dropped"
    )
    max_reply_bytes: int = Field(
        1024 * 1024,
        ge=64 * 1024,
        description="history and leases replies are cut into pages of at most this size",
    )
    max_report_bytes: int = Field(
        4096, ge=256, le=65536, description="largest 'data' of one report, as JSON"
    )
    max_reports_per_lease: int = Field(
        200, ge=10, description="reports one lease may record in the history"
    )
    # What replies not yet read by their clients may hold in migd's memory (issue 23 s5).
    max_unsent_bytes_per_uid: int = Field(
        4 * 1024 * 1024,
        ge=64 * 1024,
        description="bytes of replies one uid's connections may leave unread in migd's "
        "memory; its next request is refused until they are read or dropped (root: no limit)",
    )
    max_unsent_bytes: int = Field(
        32 * 1024 * 1024,
        ge=64 * 1024,
        description="bytes of unread replies all connections together may leave in migd's "
        "memory; further requests are refused until some are read or dropped (root's "
        "replies count, root is never refused)",
    )

    @model_validator(mode="after")
    def _unsent_holds_a_page(self) -> ApiSection:
        # A request is admitted only while a full page still fits (api_server.UnsentBytes).
        if self.max_unsent_bytes_per_uid < self.max_reply_bytes:
            raise ValueError(
                f"max_unsent_bytes_per_uid ({self.max_unsent_bytes_per_uid}) is below "
                f"max_reply_bytes ({self.max_reply_bytes}): no reply would ever be sent"
            )
        if self.max_unsent_bytes < self.max_unsent_bytes_per_uid:
            raise ValueError(
                f"max_unsent_bytes ({self.max_unsent_bytes}) is below "
                f"max_unsent_bytes_per_uid ({self.max_unsent_bytes_per_uid})"
            )
        return self


class PolicySection(_Section):
    profiles: str = Field("standard", description="standard | classic | media | all | a,b,c")
    # The names are the core's own enums: one list, here and in the planner and queue.
    placement: PlacementRule = PlacementRule.REACHABILITY
    gpu_choice: GpuChoice = GpuChoice.RULES
    fission_fusion: bool = True
    queue: QueuePolicy = QueuePolicy.FIFO
    aging_s: float = Field(600.0, ge=0)
    starvation_s: float = Field(1800.0, ge=0)
    backfill: bool | None = None
    idle_policy: Literal["keep", "destroy", "timeout"] = "timeout"
    idle_timeout_s: float = Field(300.0, ge=0)
    demand_weighting: bool = False
    demand_prior: dict[str, float] = Field(
        default_factory=dict, description="profile name or ID -> weight"
    )
    demand_half_life_s: float = Field(86400.0, gt=0)
    default_wait_s: float = Field(3600.0, ge=0)
    max_wait_s: float = Field(86400.0, ge=0)

    @field_validator("demand_prior")
    @classmethod
    def _weights_positive(cls, value: dict[str, float]) -> dict[str, float]:
        for name, weight in value.items():
            if weight < 0:
                raise ValueError(f"weight of {name!r} must not be negative")
        return value


class ReaperSection(_Section):
    interval_s: float = Field(5.0, gt=0)
    heartbeat_timeout_s: float = Field(
        0.0, ge=0, description="0: holders are judged by their process only"
    )


class MpsSection(_Section):
    control_binary: str = "nvidia-cuda-mps-control"
    reserve_mib: int = Field(1024, ge=0)
    max_clients: int = Field(48, ge=1, le=128)
    multi_user: bool = False
    idle_stop_s: float = Field(300.0, ge=0)
    require_exclusive_process: bool = Field(
        False,
        description="offer MPS only on GPUs in EXCLUSIVE_PROCESS compute mode "
        "(nvidia-smi -c; migd never sets it)",
    )
    cgroup_limits: Literal["auto", "off"] = Field(
        "auto",
        description="auto: also set an MPS share's memory as its job cgroup's limit where "
        "the driver supports it (r615+, MPS v3; docs/mps.md); off: pinned limits only",
    )
    cgroup_root: Path = Field(Path("/sys/fs/cgroup"), description="the cgroup v2 hierarchy")


class MetricsSection(_Section):
    listen: str = Field(
        "",
        description="host:port of the Prometheus/OpenMetrics endpoint (/metrics), e.g. "
        "'127.0.0.1:9464' (port 0: any free port, logged as metrics.listening); empty: no "
        "endpoint",
    )
    dcgm_job_mapping_dir: Path | None = Field(
        None,
        description="write DCGM exporter's --hpc-job-mapping-dir files (one per GPU or "
        "GPU.GI, holding the job id) into this directory",
    )
    # Who may read what /metrics shows (issue 23 s3).
    bearer_token_file: Path | None = Field(
        None,
        description="file holding a token every scrape must send as 'Authorization: Bearer "
        "<token>' (Prometheus: authorization.credentials_file); the file must not be "
        "readable by others; unset: no authentication",
    )
    identifying_labels: bool = Field(
        False,
        description="add lease_id and job_id labels to migd_mig_instance_info (who runs "
        "where); only with a loopback listen address and bearer_token_file",
    )
    max_connections: int = Field(
        8, ge=1, le=1024, description="metrics connections served at once; more get 503"
    )

    @model_validator(mode="after")
    def _identifying_only_when_restricted(self) -> MetricsSection:
        if not self.identifying_labels:
            return self
        host = self.listen.rpartition(":")[0].strip("[]")
        if not self.listen:
            problem = "needs a listen address"
        elif self.bearer_token_file is None:
            problem = "needs bearer_token_file (scrapes then need the token)"
        elif not _is_loopback(host):
            problem = f"needs a loopback listen address, not {host!r}"
        else:
            return self
        raise ValueError(
            f"identifying_labels {problem}: lease and job ids say which user's job runs "
            "where, which the API shows to their owners and admins only"
        )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"{value!r} is not host:port (e.g. '127.0.0.1:9464')")
        return value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HealthSection(_Section):
    xid_events: bool = Field(
        True,
        description="listen for NVML events (XID critical errors); a GPU with a critical "
        "error gets no new leases",
    )
    ignore_xids: list[int] = Field(
        default_factory=lambda: [13, 31, 43, 45, 68, 109],
        description="XIDs that signal an application fault, not a failing GPU (NVIDIA "
        "k8s-device-plugin's and HAMi's list)",
    )
    sim_xids: list[str] = Field(
        default_factory=list,
        description="kind=simulated: XID events injected at start-up, 'GPU:XID' or "
        "'GPU/GI:XID' (e.g. '0:79', '1/3:48')",
    )

    @field_validator("sim_xids")
    @classmethod
    def _gpu_xid(cls, value: list[str]) -> list[str]:
        for item in value:
            if not re.fullmatch(r"\d+(/\d+)?:\d+", item):
                raise ValueError(f"{item!r} is not 'GPU:XID' or 'GPU/GI:XID' (e.g. '0:79')")
        return value


class CondorSection(_Section):
    offline_gpus: bool = Field(
        True,
        description="tell HTCondor's startd which GPUs are out of service (a health "
        "condition or a drain): their shares go into OFFLINE_MACHINE_RESOURCE_GPUs in "
        "offline_file, then reconfig_command runs (docs/operations.md, GPU health)",
    )
    offline_file: Path | None = Field(
        None,
        description="the file the shipped 10-migd-execute.config includes; default "
        "<daemon.runtime_dir>/condor-offline-gpus.config (/run/migd/...)",
    )
    reconfig_command: list[str] = Field(
        default_factory=lambda: ["condor_reconfig", "-daemon", "startd"],
        min_length=1,
        description="run as migd's user (root) after the file changed",
    )
    shares_command: list[str] = Field(
        default_factory=lambda: ["condor_config_val", "MIGD_SHARES_PER_GPU"],
        min_length=1,
        description="prints the shares (HTCondor GPU IDs) per GPU that gpu-inventory lists",
    )

    check_startd: bool = Field(
        True,
        description="at start and on reload, read the startd's effective configuration "
        "with config_val_command and report knobs that bypass migd (a site file with `use "
        "FEATURE : GPUs`, START = True, another wrapper or hook): status, log, machine ad "
        "(docs/operations.md, The startd's configuration)",
    )
    config_val_command: list[str] = Field(
        default_factory=lambda: ["condor_config_val", "-subsystem", "startd"],
        min_length=1,
        description="prints one knob's value as the startd sees it (the name is appended)",
    )
    site_job_wrapper: str | None = Field(
        None,
        description="the site's own USER_JOB_WRAPPER, which ends with `exec migd-wrapper "
        '"$@"` (chaining): accepted by check_startd',
    )
    site_job_exit_hook: str | None = Field(
        None,
        description="the site's own JOB_EXIT hook (<KEYWORD>_HOOK_JOB_EXIT), which runs "
        "migd-release-hook (chaining): accepted by check_startd",
    )

    def offline_path(self, runtime_dir: Path) -> Path:
        return self.offline_file or runtime_dir / "condor-offline-gpus.config"


class GpuOverride(_Section):
    match: str = Field(description="GPU index, UUID or UUID prefix; * for every GPU")
    mode: Literal["auto", "mig", "mps", "exclusive", "off", "hybrid"] = Field(
        "auto",
        description="hybrid: a MIG GPU where migd decides per job between a MIG instance "
        "and an MPS share inside one (docs/configuration.md)",
    )
    share: Literal["either", "size", "opt-in"] = Field(
        "either",
        description='mode=hybrid: which jobs share (opt-in: MigdMode = "mps"; size: '
        "jobs that pack denser shared than in their own instance; either: both)",
    )
    profiles: str | None = None
    mps_in_mig: bool = Field(
        False,
        description="MIG GPUs: requests smaller than the smallest instance, and mode=mps "
        "requests, get an MPS share inside an instance migd makes for MPS",
    )
    mps_profile: str | None = Field(
        None, description="profile of those MPS instances (default: the smallest)"
    )


class MigdConfig(_Section):
    version: Literal[1] = 1
    daemon: DaemonSection = Field(default_factory=DaemonSection)
    backend: BackendSection = Field(default_factory=BackendSection)
    api: ApiSection = Field(default_factory=ApiSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    reaper: ReaperSection = Field(default_factory=ReaperSection)
    mps: MpsSection = Field(default_factory=MpsSection)
    wrapper: WrapperSection = Field(default_factory=WrapperSection)  # read by migd-wrapper
    metrics: MetricsSection = Field(default_factory=MetricsSection)
    health: HealthSection = Field(default_factory=HealthSection)
    htcondor: CondorSection = Field(default_factory=CondorSection)
    gpu: list[GpuOverride] = Field(default_factory=list)

    def override_for(self, index: int, uuid: str) -> GpuOverride | None:
        for o in self.gpu:
            if o.match in ("*", str(index)) or (
                o.match.startswith("GPU-") and uuid.startswith(o.match)
            ):
                return o
        return None


# Keys that only take effect at start-up; a reload that changes them says so.
RESTART_KEYS = (
    "daemon.state_dir",
    "daemon.runtime_dir",
    "backend",
    "api.socket",
    "gpu",
    "policy.profiles",
    "metrics",
    "health",
    "htcondor",
    "mps.require_exclusive_process",
)


def _set_path(data: dict[str, Any], dotted: str, value: Any, origin: str) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{part} is not a section", where=origin)
        node = child
    node[parts[-1]] = value


def _coerce(text: str) -> Any:
    """Environment/flag values: JSON when it parses (numbers, booleans, lists), else text."""
    try:
        return json.loads(text)
    except ValueError:
        lowered = text.strip().lower()
        if lowered in ("true", "yes", "on"):
            return True
        if lowered in ("false", "no", "off"):
            return False
        return text


def _env_names() -> dict[str, str]:
    """``MIGD_POLICY_QUEUE`` -> ``policy.queue`` for every key of every table section."""
    names: dict[str, str] = {}
    for section, field in MigdConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            for key in model.model_fields:
                names[f"{ENV_PREFIX}{section.upper()}_{key.upper()}"] = f"{section}.{key}"
    return names


def known_keys() -> list[str]:
    """Every key ``--set`` may name: ``section.key``, a whole section, ``version``."""
    keys = []
    for section, field in MigdConfig.model_fields.items():
        keys.append(section)
        model = field.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            keys += [f"{section}.{key}" for key in model.model_fields]
    return keys


def check_key(dotted: str) -> None:
    """Refuse a ``--set`` key that names no setting.

    Raises:
        ConfigError: not a key; the hint names the nearest one. Without this check
            ``--set polcy.queue=fifo`` failed as an unknown section of the *file*
            ("defaults: polcy"), blaming a place the value never came from.
    """
    keys = known_keys()
    if dotted in keys:
        return
    close = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    raise ConfigError(
        "no such setting",
        where=f"--set {dotted}",
        hint=(f"did you mean {close[0]}? " if close else "")
        + "`migd --print-example-config` lists every key (docs/configuration.md)",
    )


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``MIGD_POLICY_QUEUE=size`` -> ``{"policy.queue": "size"}`` for every known key.

    Raises:
        ConfigError: a ``MIGD_<SECTION>_...`` variable names no key of that section (a
            misspelt setting would otherwise be ignored without a word).
    """
    names = _env_names()
    sections = {dotted.split(".")[0] for dotted in names.values()}
    prefixes = tuple(f"{ENV_PREFIX}{section.upper()}_" for section in sorted(sections))
    out: dict[str, Any] = {}
    for var, text in environ.items():
        if var in names:
            out[names[var]] = _coerce(text)
        elif var.startswith(prefixes):
            close = difflib.get_close_matches(var, names, n=1)
            raise ConfigError(
                "no such setting",
                where=var,
                hint=(f"did you mean {close[0]}? " if close else "")
                + "MIGD_<SECTION>_<KEY> variables must name a key of docs/configuration.md",
            )
    return out


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    required: bool = False,
    flag_names: Mapping[str, str] | None = None,
) -> MigdConfig:
    """Read, merge and validate the configuration.

    Args:
        path: the TOML file; ``None`` means the default path if it exists.
        overrides: dotted keys from flags (highest precedence).
        environ: environment to read ``MIGD_*`` variables from (default: os.environ).
        required: fail if the file does not exist (an explicit ``--config``).
        flag_names: the flag that set an override (``{"api.socket": "--socket"}``), for
            error messages; others are named ``--set KEY``.

    Raises:
        ConfigError: unreadable file, bad TOML, an unknown ``MIGD_*`` setting, or values
            that fail validation; the message names every bad key and where its value
            came from (``MIGD_POLICY_QUEUE (policy.queue): ...``).
    """
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    file = path or DEFAULT_CONFIG_PATH
    if file.exists():
        data = read_toml(file)
    elif required or path is not None:
        raise ConfigError(
            "file not found",
            where=str(file),
            hint=f"write one with `migd --print-example-config > {file}` and edit it, or "
            "leave out --config for the built-in defaults",
        )
    origins: dict[str, str] = {}
    env_vars = {dotted: var for var, dotted in _env_names().items()}
    for dotted, value in env_overrides(environ).items():
        origins[dotted] = f"{env_vars[dotted]} ({dotted})"
        _set_path(data, dotted, value, origins[dotted])
    for dotted, value in dict(overrides or {}).items():
        flag = (flag_names or {}).get(dotted)
        if flag is None:
            check_key(dotted)
        origins[dotted] = f"{flag} ({dotted})" if flag else f"--set {dotted}"
        _set_path(data, dotted, value, origins[dotted])
    source = str(file) if file.exists() else "defaults"
    return validate_config(data, source=source, origins=origins)


def read_toml(file: Path) -> dict[str, Any]:
    """The settings of one file, refusing what a cut-short or garbled write leaves.

    Raises:
        ConfigError: unreadable, not UTF-8 (TOML is UTF-8; one stray byte used to raise
            an unhandled UnicodeDecodeError), not TOML, or no settings at all: an empty
            file would mean every default, so batch users would lose their lease rights
            after a truncated write; ``version = 1`` alone says "all defaults" on purpose.
    """
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", where=str(file)) from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} (line {line})",
            where=str(file),
            hint="TOML files are UTF-8; re-save the file as UTF-8 or remove that byte",
        ) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}", where=str(file)) from exc
    if not data:
        raise ConfigError(
            "the file has no settings at all (empty, or cut short?)",
            where=str(file),
            hint="write `version = 1` for every default on purpose; "
            "migd never reads an empty file as 'all defaults'",
        )
    return data


#: The [api] keys that say who may do what (docs/configuration.md, Access).
ACCESS_KEYS = (
    "lease_users",
    "lease_groups",
    "admin_users",
    "admin_groups",
    "hook_users",
    "status_public",
    "socket_group",
)


def _taken(key: str, before: Any, after: Any, new: ApiSection) -> bool:
    """Whether ``key`` going from ``before`` to ``after`` takes something away."""
    if key == "status_public":  # private status made public: what users may see
        return bool(after) and not before
    if key == "socket_group":  # its members can no longer connect to a private socket
        public = new.status_public or "*" in new.lease_users or "*" in new.lease_groups
        return not public
    return bool(set(before) - set(after))  # users or groups that lose a right


def removals(old: MigdConfig, new: MigdConfig) -> list[str]:
    """What going from ``old`` (running) to ``new`` would take away without saying so.

    * an access key that the new configuration does not set any more, whose default
      takes away a right (or makes a private status public): a file cut short after its
      first lines turned ``lease_users = ["batch"]`` into ``["root", "condor"]``;
    * lease rights for no one at all (``lease_users`` and ``lease_groups`` empty), where
      someone had them;
    * no ``[[gpu]]`` table left, where there were some.

    An edit that names its keys (``lease_users = ["alice"]`` instead of
    ``["alice", "bob"]``) is not a removal: it says what it means. A reload refuses any
    of these unless it is asked for explicitly (``migctl reload --allow-removals``).
    """
    found = []
    for key in ACCESS_KEYS:
        before, after = getattr(old.api, key), getattr(new.api, key)
        if (
            before != after
            and key not in new.api.model_fields_set
            and _taken(key, before, after, new.api)
        ):
            found.append(
                f"api.{key} is no longer set, so it would fall back to its default "
                f"({json.dumps(after)} instead of {json.dumps(before)})"
            )
    if (old.api.lease_users or old.api.lease_groups) and not (
        new.api.lease_users or new.api.lease_groups
    ):
        found.append("api.lease_users and api.lease_groups are both empty: no one could lease")
    if old.gpu and not new.gpu:
        found.append(f"none of the {len(old.gpu)} [[gpu]] table(s) is left")
    return found


def _origin(loc: str, source: str, origins: Mapping[str, str]) -> str:
    """Where the value at ``loc`` came from: its variable or flag, else the file."""
    for dotted, origin in origins.items():
        if loc == dotted or loc.startswith((f"{dotted}.", f"{dotted}[")):
            return origin
    return f"{source}: {loc}" if loc else source


def validate_config(
    data: Mapping[str, Any], *, source: str = "config", origins: Mapping[str, str] | None = None
) -> MigdConfig:
    """Validate a parsed mapping; ConfigError lists every problem with its location.

    ``origins`` maps dotted keys set outside the file (variables, flags) to their name.
    """
    origins = origins or {}
    version = data.get("version", 1)
    if version != 1:
        raise ConfigError(
            f"unsupported config version {version!r} (this migd reads version 1)",
            where=_origin("version", source, origins),
        )
    try:
        return MigdConfig.model_validate(dict(data))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in err["loc"])
            problems.append((_origin(loc.replace(".[", "["), source, origins), err["msg"]))
        if len(problems) == 1:
            where, message = problems[0]
            raise ConfigError(message, where=where) from exc
        raise ConfigError("; ".join(f"{where}: {msg}" for where, msg in problems)) from exc


def changed_restart_keys(old: MigdConfig, new: MigdConfig) -> list[str]:
    """Keys whose change needs a restart (a reload keeps their old values)."""
    changed = []
    for dotted in RESTART_KEYS:
        a: Any = old
        b: Any = new
        for part in dotted.split("."):
            a, b = getattr(a, part), getattr(b, part)
        if a != b:
            changed.append(dotted)
    return changed


def example_toml() -> str:
    """A commented example file with every key at its default."""
    lines = [
        "# migd configuration (version 1). Every key can also be set with MIGD_<SECTION>_<KEY>",
        "# (e.g. MIGD_POLICY_QUEUE=size) or `migd --set section.key=value`.",
        "version = 1",
    ]
    for section, field in MigdConfig.model_fields.items():
        if section in ("version", "gpu"):
            continue
        model = field.annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        lines.append(f"\n[{section}]")
        for key, sub in model.model_fields.items():
            default = sub.get_default(call_default_factory=True)
            if default is None:
                lines.append(f"# {key} =   # unset")
                continue
            value = json.dumps(str(default) if isinstance(default, Path) else default)
            comment = f"  # {sub.description}" if sub.description else ""
            lines.append(f"{key} = {value}{comment}")
    lines += [
        "\n# Per-GPU overrides (repeat the table for each GPU):",
        "# [[gpu]]",
        '# match = "0"            # index, UUID or UUID prefix',
        '# mode = "mps"           # auto | mig | mps | exclusive | off | hybrid',
        "# mps_in_mig = false     # MIG GPUs: small and mode=mps jobs share MPS instances",
        '# mps_profile = "1g.10gb"  # profile of those instances (default: the smallest)',
    ]
    return "\n".join(lines) + "\n"
