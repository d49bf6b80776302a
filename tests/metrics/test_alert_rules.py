"""The shipped Prometheus alert rules (contrib/prometheus/migd-alerts.yml): valid for
Prometheus (`promtool check rules`), each alert fires when and only when its unit test
says (`promtool test rules` with migd-alerts.test.yml), and every migd metric they read
is one migd exports (a renamed metric would otherwise leave an alert that never fires)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "contrib" / "prometheus" / "migd-alerts.yml"
RULE_TESTS = RULES.with_name("migd-alerts.test.yml")
ALERTS = {
    "MigdDown",
    "MigdUnhealthy",
    "MigdGpuUnhealthy",
    "MigdQueueWaitLong",
    "MigdLeasesLost",
    "MigdStateDiskFull",
}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "promtool is not installed (Debian: apt-get install prometheus; scripts/test.sh does)"
        )
    return subprocess.run(
        [promtool, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=RULES.parent,
        check=False,
    )


def test_promtool_checks_the_rules() -> None:
    proc = _promtool("check", "rules", RULES.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout, proc.stdout


def test_promtool_unit_tests_of_every_alert_pass() -> None:
    proc = _promtool("test", "rules", RULE_TESTS.name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text(encoding="utf-8")))
    assert tested == ALERTS


def test_the_rules_read_only_metrics_migd_exports() -> None:
    sources = "".join(
        p.read_text(encoding="utf-8") for p in (REPO / "migd" / "daemon" / "metrics").glob("*.py")
    )
    exported = set(re.findall(r'"(migd_[a-z_]+)"', sources))
    used = set(re.findall(r"\b(migd_[a-z_]+)", RULES.read_text(encoding="utf-8")))
    assert used, "no migd metric in the rules"
    for name in used:
        # prometheus_client adds _total to a Counter's name
        assert name in exported or name.removesuffix("_total") in exported, name
    names = set(re.findall(r"- alert: (\w+)", RULES.read_text(encoding="utf-8")))
    assert names == ALERTS
