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

Plainly valid values (the usual case, the shipped file's included) are read without
pydantic (:func:`migd.wrapper_options.quick_options`): importing it and building the
section's model would cost every GPU job more CPU than the rest of its start. Anything
else is validated by the model, ``WrapperSection``, as the daemon does.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from migd.core.forecast import ForecastPolicy
from migd.core.oom import OomPolicy
from migd.errors import ConfigError
from migd.wrapper_options import RULES, WrapperOptions, quick_options

if TYPE_CHECKING:
    from pydantic import ValidationError

__all__ = ["WrapperOptions", "WrapperSettings", "load_settings"]

DEFAULT_CONFIG_PATH = Path("/etc/migd/migd.toml")
CONFIG_ENV = "MIGD_CONFIG"
ENV_PREFIX = "MIGD_WRAPPER_"
# Older name of MIGD_WRAPPER_SAMPLE_INTERVAL_S, still read.
LEGACY_ENV = {"MIGD_SAMPLE_INTERVAL_S": "sample_interval_s"}


@dataclass(frozen=True)
class WrapperSettings:
    """The validated settings and where they came from (for the debug log)."""

    section: WrapperOptions = field(default_factory=WrapperOptions)
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
    keys = RULES
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
    options = quick_options(data)
    if options is None:
        options = _validated(data, origin)
    return WrapperSettings(options, tuple(sources), tuple(notes))


def _validated(data: Mapping[str, Any], origin: Mapping[str, str]) -> WrapperOptions:
    """``data`` through the section's model: what it accepts, or what is wrong with it."""
    from pydantic import ValidationError

    from migd.wrapper_section import WrapperSection

    try:
        model = WrapperSection.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            _problems(exc, origin),
            hint="fix [wrapper] in migd.toml or the MIGD_WRAPPER_* variable "
            "(docs/wrapper.md, Settings)",
        ) from exc
    return WrapperOptions(**{name: getattr(model, name) for name in RULES})
