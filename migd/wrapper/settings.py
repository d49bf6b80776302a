"""The wrapper's settings: the ``[wrapper]`` section of migd.toml and ``MIGD_WRAPPER_*``.

The wrapper runs as the job's user, so it reads only the ``[wrapper]`` section of
``/etc/migd/migd.toml`` (``$MIGD_CONFIG`` to use another file), and only if that
user may read the file (install it ``0644``; nothing in it is secret). Precedence,
lowest first: the defaults below, the file, ``MIGD_WRAPPER_<KEY>`` environment
variables (a job can set them with ``environment = ...`` in its submit file), then
the per-job attributes and ``migd-run`` flags (``MigdEarlyRestart``,
``MigdHorizon``, ...). migd itself validates the same section (``migd
--check-config``), so a bad value is caught when the daemon starts or reloads.

Invalid values are a :class:`~migd.errors.ConfigError` naming the key and where it
came from; the wrapper then refuses the job with that message instead of guessing.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from migd.core.forecast import ForecastPolicy
from migd.core.oom import OomPolicy
from migd.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/migd/migd.toml")
CONFIG_ENV = "MIGD_CONFIG"
ENV_PREFIX = "MIGD_WRAPPER_"
# Older name of MIGD_WRAPPER_SAMPLE_INTERVAL_S, still read.
LEGACY_ENV = {"MIGD_SAMPLE_INTERVAL_S": "sample_interval_s"}


class WrapperSection(BaseModel):
    """``[wrapper]`` in migd.toml: what the job wrapper does (it runs as the job's user)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sample_interval_s: float = Field(
        2.0, gt=0, le=3600, description="how often the wrapper samples the job's GPU memory"
    )
    term_grace_s: float = Field(
        10.0, ge=0, description="SIGTERM to SIGKILL when the forecast stops a job early"
    )
    restart_wait_s: float = Field(
        600.0, ge=0, description="how long a restart waits for the bigger partition"
    )
    chirp_timeout_s: float = Field(
        30.0, gt=0, description="longest one condor_chirp update of the job ad may take"
    )
    log_level: Literal["info", "debug"] = Field(
        "info", description="debug: also log forecast decisions that do not fire, with the fit"
    )
    decision_log_interval_s: float = Field(
        60.0, ge=0, description="at debug, log a non-firing forecast at most this often"
    )
    forecast_confidence: float = Field(0.99, gt=0.5, lt=1.0, description="band coverage")
    forecast_one_sided: bool = True
    forecast_z: float | None = Field(None, ge=0, description="fixed band multiplier")
    forecast_student_t: bool = True
    forecast_leverage: bool = True
    forecast_min_samples: int = Field(5, ge=3)
    forecast_convergence_window: int = Field(4, ge=1)
    forecast_convergence_rel_tol: float = Field(0.03, ge=0)
    forecast_convergence_abs_mib: float = Field(128.0, ge=0)
    forecast_safety_margin_mib: float = Field(256.0, ge=0)
    forecast_safety_margin_frac: float = Field(0.03, ge=0, lt=1)
    forecast_lookahead_factor: float = Field(1.0, ge=0)
    forecast_warmup_steps: float = Field(0.0, ge=0)
    forecast_time_warmup_s: float = Field(
        30.0,
        ge=0,
        description="a job that reports no iterations: ignore NVML samples of its first seconds",
    )
    forecast_series: Literal["auto", "reuse", "allocated", "used"] = "auto"
    forecast_context_mib: float | None = Field(None, ge=0)
    oom_weak_fraction: float = Field(
        0.97, gt=0, le=1, description="peak/limit from which a silent failure is a weak OOM"
    )
    oom_corroborate_fraction: float = Field(
        0.90, gt=0, le=1, description="peak/limit that makes an ambiguous message an OOM"
    )
    oom_weak_retries: int = Field(1, ge=0, description="restarts allowed on weak evidence")

    _forecast: ForecastPolicy = PrivateAttr()
    _oom: OomPolicy = PrivateAttr()

    @model_validator(mode="after")
    def _build_policies(self) -> WrapperSection:
        """Build the forecast and OOM policies once; a value they refuse is invalid."""
        try:
            self._forecast = ForecastPolicy(
                **{
                    name.removeprefix("forecast_"): getattr(self, name)
                    for name in type(self).model_fields
                    if name.startswith("forecast_") and name != "forecast_time_warmup_s"
                }
            )
            self._oom = OomPolicy(
                weak_fraction=self.oom_weak_fraction,
                corroborate_fraction=self.oom_corroborate_fraction,
                weak_retries=self.oom_weak_retries,
            )
        except ConfigError as exc:
            raise ValueError(exc.message) from exc
        return self

    @property
    def forecast(self) -> ForecastPolicy:
        return self._forecast

    @property
    def oom(self) -> OomPolicy:
        return self._oom


@dataclass(frozen=True)
class WrapperSettings:
    """The validated settings and where they came from (for the debug log)."""

    section: WrapperSection = field(default_factory=WrapperSection)
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def forecast(self) -> ForecastPolicy:
        return self.section.forecast

    @property
    def oom(self) -> OomPolicy:
        return self.section.oom

    @property
    def debug(self) -> bool:
        return self.section.log_level == "debug"


def _problems(exc: ValidationError, origin: Mapping[str, str]) -> str:
    out = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "wrapper"
        where = origin.get(key, "")
        out.append(f"wrapper.{key}{f' ({where})' if where else ''}: {err['msg']}")
    return "; ".join(out)


def load_settings(
    environ: Mapping[str, str] | None = None, path: Path | None = None
) -> WrapperSettings:
    """Read, merge and validate the wrapper's settings.

    A missing or unreadable file is not an error (the defaults apply; the reason is in
    ``notes``); a file that is not TOML, an unknown key or a bad value is.

    Raises:
        ConfigError: names the key, the value's origin and what is wrong with it.
    """
    environ = os.environ if environ is None else environ
    file = path or Path(environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}
    sources: list[str] = []
    notes: list[str] = []
    try:
        text = file.read_text()
    except FileNotFoundError:
        notes.append(f"no {file}: built-in wrapper defaults")
    except OSError as exc:
        notes.append(
            f"cannot read {file} ({exc.strerror}): built-in wrapper defaults; make it "
            "readable by job users (0644) for its [wrapper] section to apply"
        )
    else:
        try:
            section = tomllib.loads(text).get("wrapper", {})
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"not valid TOML: {exc}", where=str(file)) from exc
        if not isinstance(section, dict):
            raise ConfigError("[wrapper] must be a table", where=str(file))
        data.update(section)
        origin.update({key: str(file) for key in section})
        sources.append(str(file))
    keys = WrapperSection.model_fields
    for var, key in LEGACY_ENV.items():
        if var in environ and f"{ENV_PREFIX}{key.upper()}" not in environ:
            data[key], origin[key] = environ[var], var
    for key in keys:
        var = f"{ENV_PREFIX}{key.upper()}"
        if var in environ:
            raw = environ[var].strip()
            data[key] = None if raw.lower() in ("", "none", "null") else raw
            origin[key] = var
    unknown = sorted(
        var
        for var in environ
        if var.startswith(ENV_PREFIX) and var.removeprefix(ENV_PREFIX).lower() not in keys
    )
    if unknown:
        raise ConfigError(
            f"unknown wrapper setting {', '.join(unknown)}",
            hint=f"known: {', '.join(ENV_PREFIX + k.upper() for k in keys)}",
        )
    env_vars = sorted(v for k, v in origin.items() if v.startswith("MIGD_"))
    sources.extend(env_vars)
    try:
        section_model = WrapperSection.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            _problems(exc, origin),
            hint="fix [wrapper] in migd.toml or the MIGD_WRAPPER_* variable "
            "(docs/wrapper.md, Settings)",
        ) from exc
    return WrapperSettings(section_model, tuple(sources), tuple(notes))
