"""The ``[wrapper]`` section's values without pydantic, for the start of every GPU job.

:class:`migd.wrapper_section.WrapperSection` (pydantic) defines the section, and the daemon
validates it with that model. The wrapper runs at the start of every GPU job, where
importing pydantic and building the model cost more CPU than the rest of the wrapper's
start (``bench/results/wrapper_start.md``). So the wrapper first tries
:func:`quick_options`: values that are plainly valid (the field's own type inside its
bounds, or a plain number or true/false written as text) become :class:`WrapperOptions`
directly; anything else (an unknown key, a value that needs coercing, one out of bounds)
goes through ``WrapperSection``, which accepts it or names the problem exactly as before.

tests/unit/test_wrapper_options.py holds :data:`RULES` and :class:`WrapperOptions` to the
model's fields, and checks that the quick path never accepts what the model refuses nor
reads a value differently.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from migd.core.forecast import ForecastPolicy
from migd.core.oom import OomPolicy
from migd.errors import ConfigError


def policies(values: Mapping[str, Any]) -> tuple[ForecastPolicy, OomPolicy]:
    """The forecast and OOM policies a ``[wrapper]`` section describes.

    Raises:
        ConfigError: a value the policies refuse.
    """
    forecast = ForecastPolicy(
        **{
            name.removeprefix("forecast_"): value
            for name, value in values.items()
            if name.startswith("forecast_") and name != "forecast_time_warmup_s"
        }
    )
    oom = OomPolicy(
        weak_fraction=values["oom_weak_fraction"],
        corroborate_fraction=values["oom_corroborate_fraction"],
        weak_retries=values["oom_weak_retries"],
    )
    return forecast, oom


@dataclass(frozen=True)
class Rule:
    """What a field accepts: ``kind`` is "float", "int", "bool" or "choice"."""

    kind: str
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    optional: bool = False

    def within(self, value: float) -> bool:
        """Inside the bounds (NaN is not: every comparison with it is false)."""
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )


# WrapperSection's fields and constraints (the test derives the same table from the model).
RULES: dict[str, Rule] = {
    "sample_interval_s": Rule("float", gt=0, le=3600),
    "term_grace_s": Rule("float", ge=0),
    "restart_wait_s": Rule("float", ge=0),
    "chirp_timeout_s": Rule("float", gt=0),
    "wait_notice_s": Rule("float", ge=0),
    "log_level": Rule("choice", choices=("info", "debug")),
    "decision_log_interval_s": Rule("float", ge=0),
    "forecast_confidence": Rule("float", gt=0.5, lt=1.0),
    "forecast_one_sided": Rule("bool"),
    "forecast_z": Rule("float", ge=0, optional=True),
    "forecast_student_t": Rule("bool"),
    "forecast_leverage": Rule("bool"),
    "forecast_min_samples": Rule("int", ge=3),
    "forecast_convergence_window": Rule("int", ge=1),
    "forecast_convergence_rel_tol": Rule("float", ge=0),
    "forecast_convergence_abs_mib": Rule("float", ge=0),
    "forecast_safety_margin_mib": Rule("float", ge=0),
    "forecast_safety_margin_frac": Rule("float", ge=0, lt=1),
    "forecast_lookahead_factor": Rule("float", ge=0),
    "forecast_warmup_steps": Rule("float", ge=0),
    "forecast_time_warmup_s": Rule("float", ge=0),
    "forecast_series": Rule("choice", choices=("auto", "reuse", "allocated", "used")),
    "forecast_context_mib": Rule("float", ge=0, optional=True),
    "oom_weak_fraction": Rule("float", gt=0, le=1),
    "oom_corroborate_fraction": Rule("float", gt=0, le=1),
    "oom_weak_retries": Rule("int", ge=0),
}


@dataclass(frozen=True)
class WrapperOptions:
    """The validated ``[wrapper]`` values, as the wrapper reads them (defaults: the model's)."""

    sample_interval_s: float = 2.0
    term_grace_s: float = 10.0
    restart_wait_s: float = 600.0
    chirp_timeout_s: float = 30.0
    wait_notice_s: float = 5.0
    log_level: Literal["info", "debug"] = "info"
    decision_log_interval_s: float = 60.0
    forecast_confidence: float = 0.99
    forecast_one_sided: bool = True
    forecast_z: float | None = None
    forecast_student_t: bool = True
    forecast_leverage: bool = True
    forecast_min_samples: int = 5
    forecast_convergence_window: int = 4
    forecast_convergence_rel_tol: float = 0.03
    forecast_convergence_abs_mib: float = 128.0
    forecast_safety_margin_mib: float = 256.0
    forecast_safety_margin_frac: float = 0.03
    forecast_lookahead_factor: float = 1.0
    forecast_warmup_steps: float = 0.0
    forecast_time_warmup_s: float = 30.0
    forecast_series: Literal["auto", "reuse", "allocated", "used"] = "auto"
    forecast_context_mib: float | None = None
    oom_weak_fraction: float = 0.97
    oom_corroborate_fraction: float = 0.90
    oom_weak_retries: int = 1
    # Built once from the values above (ConfigError where they refuse them).
    forecast: ForecastPolicy = field(init=False, repr=False, compare=False)
    oom: OomPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        forecast, oom = policies({name: getattr(self, name) for name in RULES})
        object.__setattr__(self, "forecast", forecast)
        object.__setattr__(self, "oom", oom)


class _Unsure(Exception):
    """The quick path cannot vouch for a value: the model decides."""


def _from_text(text: str, kind: str) -> object:
    """A number or flag written as plain text (an environment variable), else unsure."""
    if kind == "bool" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    digits = text.removeprefix("-") if kind == "float" else text
    whole, dot, fraction = digits.partition(".") if kind == "float" else (digits, "", "")
    plain = whole.isascii() and whole.isdigit() and (len(whole) == 1 or whole[0] != "0")
    if (
        kind in ("float", "int")
        and plain
        and (not dot or (fraction.isascii() and fraction.isdigit()))
    ):
        return float(text) if kind == "float" else int(text)
    raise _Unsure


def _accept(rule: Rule, raw: object) -> object:
    if raw is None:
        if rule.optional:
            return None
        raise _Unsure
    if isinstance(raw, str) and rule.kind != "choice":
        raw = _from_text(raw, rule.kind)
    if rule.kind == "bool":
        if isinstance(raw, bool):
            return raw
        raise _Unsure
    if rule.kind == "choice":
        if isinstance(raw, str) and raw in rule.choices:
            return raw
        raise _Unsure
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise _Unsure
    if rule.kind == "int" and not isinstance(raw, int):
        raise _Unsure
    try:
        value: float = float(raw) if rule.kind == "float" else raw
    except OverflowError:
        raise _Unsure from None
    if math.isinf(value) or not rule.within(value):
        raise _Unsure
    return value


def quick_options(data: Mapping[str, Any]) -> WrapperOptions | None:
    """``data`` as :class:`WrapperOptions` where every value is plainly valid, else None
    (then ``WrapperSection`` decides, and names what is wrong)."""
    values: dict[str, Any] = {}
    try:
        for key, raw in data.items():
            rule = RULES.get(key)
            if rule is None:
                return None
            values[key] = _accept(rule, raw)
        return WrapperOptions(**values)
    except (_Unsure, ConfigError):
        return None
