"""The startd's effective configuration, checked at start and on every reload.

:mod:`migd.core.startd_settings` decides which knobs bypass migd; this module reads them
through the :class:`~migd.ports.StartdConfig` port, keeps the answer for ``status`` (and
so ``migctl status`` and ``migctl condor-ad``'s machine ad) and logs each finding once per
check. A finding is a node-level condition, not a GPU one: migd keeps serving (``migd-run``
and a startd fixed later both need it), and says loudly that HTCondor's jobs go around it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import structlog

from migd.core.startd_settings import StartdFinding, check_startd, read_knobs, slot_layout
from migd.daemon.config import CondorSection
from migd.errors import StartdError
from migd.ports import StartdConfig

log = structlog.get_logger("migd.startd_check")


@dataclass
class StartdReport:
    """The last check: ``skipped`` says why there is none (no HTCondor, turned off)."""

    checked_s: float | None = None
    findings: list[StartdFinding] = field(default_factory=list)
    layout: str | None = None
    skipped: str | None = "not checked yet"

    @property
    def ok(self) -> bool:
        return not self.findings

    def reason(self) -> str:
        """One line for the machine ad (empty when nothing bypasses migd)."""
        if not self.findings:
            return ""
        return "startd bypasses migd: " + "; ".join(f.line for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked_s": self.checked_s,
            "skipped": self.skipped,
            "slot_layout": self.layout,
            "problems": [f.to_dict() for f in self.findings],
        }


def check_startd_config(
    port: StartdConfig | None, section: CondorSection, now: float
) -> StartdReport:
    """Read the knobs through ``port`` and check them (blocking: runs HTCondor's tool)."""
    if port is None or not section.check_startd:
        return StartdReport(skipped="[htcondor] check_startd = false")
    try:
        values = read_knobs(port.value)
    except StartdError as exc:
        return StartdReport(checked_s=now, skipped=exc.message)
    return StartdReport(
        checked_s=now,
        findings=check_startd(
            values,
            site_job_wrapper=section.site_job_wrapper,
            site_job_exit_hook=section.site_job_exit_hook,
        ),
        layout=slot_layout(values),
        skipped=None,
    )


def log_report(report: StartdReport) -> None:
    if report.skipped is not None:
        log.info("startd.config_not_checked", reason=report.skipped)
        return
    for finding in report.findings:
        log.warning(
            "startd.bypasses_migd",
            knob=finding.knob,
            value=finding.value,
            problem=finding.problem,
            hint=finding.fix,
        )
    if report.ok:
        log.info("startd.config_ok", slot_layout=report.layout)


async def run_check(port: StartdConfig | None, section: CondorSection, now: float) -> StartdReport:
    """:func:`check_startd_config` off the event loop, logged."""
    report = await asyncio.to_thread(check_startd_config, port, section, now)
    log_report(report)
    return report
