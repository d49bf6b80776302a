"""The ``[wrapper]`` section of migd.toml, as one model both of its readers validate.

Two programs read this section: the job wrapper (``migd/wrapper/settings.py``, running as
the job's user, with ``MIGD_WRAPPER_*`` overrides) and the daemon (``migd/daemon/config.py``,
so ``migd --check-config`` and a reload catch a bad value before a job meets it). The model
lives here, beside neither, so that the daemon does not depend on the wrapper package nor the
wrapper on the daemon's; both depend on this module and on the pure core it builds policies
from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from migd.core.forecast import ForecastPolicy
from migd.core.oom import OomPolicy
from migd.errors import ConfigError
from migd.wrapper_options import policies


class WrapperSection(BaseModel):
    """``[wrapper]`` in migd.toml: what the job wrapper does (it runs as the job's user)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sample_interval_s: float = Field(
        2.0, gt=0, le=3600, description="how often the wrapper samples the job's GPU memory"
    )
    term_grace_s: float = Field(
        10.0,
        ge=0,
        description="first signal to SIGKILL when the wrapper stops a job: the forecast's "
        "early restart, a lease migd took back",
    )
    restart_wait_s: float = Field(
        600.0, ge=0, description="how long a restart waits for the bigger partition"
    )
    chirp_timeout_s: float = Field(
        30.0, gt=0, description="longest one condor_chirp update of the job ad may take"
    )
    wait_notice_s: float = Field(
        5.0,
        ge=0,
        description="a job still waiting for its partition after this long says so",
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
            self._forecast, self._oom = policies(
                {name: getattr(self, name) for name in type(self).model_fields}
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
