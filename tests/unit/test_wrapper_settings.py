"""The wrapper's settings ([wrapper] in migd.toml, MIGD_WRAPPER_*) and its chirp boundary."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from migd.backends.condor import chirp_value, set_job_attrs
from migd.daemon.config import load_config
from migd.errors import ChirpError, ConfigError
from migd.wrapper.settings import load_settings

NO_FILE = Path("/nonexistent/migd.toml")


def test_defaults_are_the_policies_defaults() -> None:
    settings = load_settings({}, NO_FILE)
    assert settings.forecast.min_samples == 5 and settings.forecast.confidence == 0.99
    assert settings.oom.weak_fraction == 0.97 and settings.oom.weak_retries == 1
    assert settings.section.sample_interval_s == 2.0 and not settings.debug
    assert settings.notes == (f"no {NO_FILE}: built-in wrapper defaults",)


def test_file_then_environment(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text(
        "version = 1\n[daemon]\nlog_level = 'debug'\n"  # other sections are not the wrapper's
        "[wrapper]\nforecast_min_samples = 8\noom_weak_retries = 0\nsample_interval_s = 5\n"
    )
    settings = load_settings({"MIGD_WRAPPER_SAMPLE_INTERVAL_S": "0.5"}, config)
    assert settings.forecast.min_samples == 8
    assert settings.oom.weak_retries == 0
    assert settings.section.sample_interval_s == 0.5  # the environment wins
    assert settings.sources == (str(config), "MIGD_WRAPPER_SAMPLE_INTERVAL_S")
    via_env = load_settings({"MIGD_CONFIG": str(config)})
    assert via_env.forecast.min_samples == 8


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MIGD_SAMPLE_INTERVAL_S": "abc"}, "wrapper.sample_interval_s (MIGD_SAMPLE_INTERVAL_S)"),
        ({"MIGD_WRAPPER_SAMPLE_INTERVAL_S": "0"}, "greater than 0"),
        ({"MIGD_WRAPPER_FORECAST_CONFIDENCE": "1.2"}, "forecast_confidence"),
        ({"MIGD_WRAPPER_FORECAST_MIN_SAMPLES": "2"}, "forecast_min_samples"),
        ({"MIGD_WRAPPER_FORECAST_SERIES": "vram"}, "forecast_series"),
        ({"MIGD_WRAPPER_OOM_WEAK_FRACTION": "1.5"}, "oom_weak_fraction"),
        ({"MIGD_WRAPPER_LOG_LEVEL": "chatty"}, "log_level"),
        ({"MIGD_WRAPPER_MIN_SAMPLES": "8"}, "unknown wrapper setting MIGD_WRAPPER_MIN_SAMPLES"),
    ],
)
def test_bad_values_name_the_key_and_where_it_came_from(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings(env, NO_FILE)


def test_bad_file_is_an_error_and_unreadable_one_a_note(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[wrapper\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings({}, broken)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[wrapper]\nsample_every = 3\n")
    with pytest.raises(ConfigError, match=f"wrapper.sample_every \\({unknown}\\)"):
        load_settings({}, unknown)
    if os.geteuid() != 0:  # root reads everything
        secret = tmp_path / "secret.toml"
        secret.write_text("[wrapper]\n")
        secret.chmod(0)
        assert "cannot read" in load_settings({}, secret).notes[0]


def test_the_daemon_validates_the_same_section(tmp_path: Path) -> None:
    config = tmp_path / "migd.toml"
    config.write_text("version = 1\n[wrapper]\nforecast_min_samples = 2\n")
    with pytest.raises(ConfigError, match=r"wrapper\.forecast_min_samples"):
        load_config(config, environ={})
    config.write_text("version = 1\n[wrapper]\nforecast_min_samples = 9\n")
    assert load_config(config, environ={}).wrapper.forecast_min_samples == 9


def test_chirp_values_are_classad_literals() -> None:
    assert chirp_value(True) == "true" and chirp_value(40449) == "40449"
    assert chirp_value('say "hi"') == '"say \\"hi\\""'


def _chirp_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    binary = tmp_path / "condor_chirp"
    binary.write_text(f"#!/bin/sh\n{body}\n")
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("_CONDOR_CHIRP_CONFIG", raising=False)


def test_chirp_failures_are_migd_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _chirp_on_path(tmp_path, monkeypatch, "sleep 10")
    with pytest.raises(ChirpError, match=r"did not answer within 0\.2 s"):
        set_job_attrs({"RequestVRAM": 1}, timeout_s=0.2)
    _chirp_on_path(tmp_path, monkeypatch, "echo 'Error: 22 (Invalid argument)' >&2; exit 255")
    with pytest.raises(ChirpError, match="Invalid argument"):
        set_job_attrs({"RequestVRAM": 1})
    (tmp_path / "condor_chirp").write_bytes(b"\x7fELF not really")  # exec format error
    with pytest.raises(ChirpError, match="cannot run"):
        set_job_attrs({"RequestVRAM": 1})


def test_chirp_sets_every_attribute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "calls"
    _chirp_on_path(tmp_path, monkeypatch, f'echo "$@" >> {log}')
    set_job_attrs({"RequestVRAM": 9985, "MigdOomExit": True})
    assert log.read_text().splitlines() == [
        "set_job_attr RequestVRAM 9985",
        "set_job_attr MigdOomExit true",
    ]
