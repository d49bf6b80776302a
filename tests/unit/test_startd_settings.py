"""The startd's effective configuration against migd's settings (issue 24 s3).

A site file in /etc/condor/config.d (``use FEATURE : GPUs``, ``START = True``, its own job
wrapper or hook) silently undoes migd's execute-node file; migd reads the knobs the startd
would use and reports each one that makes HTCondor's jobs go around it.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from migd.backends.condor import CondorConfigVal
from migd.cli.condor_ad import render_condor_ad
from migd.cli.migctl import render_status
from migd.core.startd_settings import KNOBS, check_startd, read_knobs, slot_layout
from migd.daemon.config import CondorSection, validate_config
from migd.daemon.supervision.startd_check import StartdReport, check_startd_config
from migd.errors import StartdError

# The values condor_config_val -subsystem startd prints with migd's execute-node file
# (condor_config/10-migd-execute.config) and nothing overriding it (macros expanded).
SHIPPED: dict[str, str | None] = {
    "USER_JOB_WRAPPER": "/usr/bin/migd-wrapper",
    "STARTER_JOB_HOOK_KEYWORD": "MIGD",
    "MIGD_HOOK_JOB_EXIT": "/usr/bin/migd-release-hook",
    "MACHINE_RESOURCE_INVENTORY_GPUs": "/usr/bin/migctl gpu-inventory --shares 7",
    "START": "(True) && (((TARGET.RequestGPUs ?: 0) == 0 && (TARGET.RequestVRAM ?: 0) == 0) "
    "|| ((MigdHealthy =?= true) && (TARGET.RequestVRAM ?: 0) <= (MigdLargestPlaceableMB ?: 0)))",
    "NUM_SLOTS_TYPE_1": "1",
    "SLOT_TYPE_1_PARTITIONABLE": "True",
}

# What a site file does to each knob (HTCondor 23.9: `use FEATURE : GPUs` sets the
# inventory to condor_gpu_discovery; a plain START replaces migd's).
OVERRIDES: dict[str, dict[str, str | None]] = {
    "USER_JOB_WRAPPER": {"USER_JOB_WRAPPER": "/usr/local/libexec/site-wrapper"},
    "MIGD_HOOK_JOB_EXIT": {"STARTER_JOB_HOOK_KEYWORD": "SITE", "SITE_HOOK_JOB_EXIT": "/bin/x"},
    "MACHINE_RESOURCE_INVENTORY_GPUs": {
        "MACHINE_RESOURCE_INVENTORY_GPUs": "/usr/libexec/condor/condor_gpu_discovery "
        "-properties -extra"
    },
    "START": {"START": "True"},
}


class FakeStartdConfig:
    """:class:`migd.ports.StartdConfig` over a dict; counts reads; can fail."""

    def __init__(self, values: Mapping[str, str | None], error: str | None = None) -> None:
        self.values = dict(values)
        self.error = error
        self.reads: list[str] = []

    def value(self, name: str) -> str | None:
        self.reads.append(name)
        if self.error:
            raise StartdError(self.error)
        return self.values.get(name)


def test_the_shipped_settings_pass() -> None:
    assert check_startd(SHIPPED) == []
    assert slot_layout(SHIPPED) == "partitionable"


@pytest.mark.parametrize(
    "overridden",
    [
        combo
        for n in range(len(OVERRIDES) + 1)
        for combo in itertools.combinations(sorted(OVERRIDES), n)
    ],
)
def test_each_override_is_reported_and_only_it(overridden: tuple[str, ...]) -> None:
    """Every subset of the four overrides: the findings name exactly those knobs."""
    values = dict(SHIPPED)
    for knob in overridden:
        values.update(OVERRIDES[knob])
    expected = {("SITE_HOOK_JOB_EXIT" if k == "MIGD_HOOK_JOB_EXIT" else k) for k in overridden}
    found = check_startd(values)
    assert {f.knob for f in found} == expected
    for finding in found:
        assert finding.problem and finding.fix and finding.knob in finding.line


def test_undefined_knobs_are_reported_as_undefined() -> None:
    found = {f.knob: f for f in check_startd(dict.fromkeys(KNOBS))}
    assert set(found) == {
        "USER_JOB_WRAPPER",
        "STARTER_JOB_HOOK_KEYWORD",
        "MACHINE_RESOURCE_INVENTORY_GPUs",
        "START",
    }
    assert all(f.value is None and "undefined" in f.line for f in found.values())
    assert slot_layout(dict.fromkeys(KNOBS)).endswith("HTCondor's default)")


def test_a_chained_site_wrapper_and_hook_are_accepted() -> None:
    """The documented chaining: the site's wrapper execs migd-wrapper, its hook runs
    migd-release-hook, and [htcondor] names them."""
    values = dict(SHIPPED)
    values.update(OVERRIDES["USER_JOB_WRAPPER"])
    values.update(OVERRIDES["MIGD_HOOK_JOB_EXIT"])
    assert len(check_startd(values)) == 2
    chained = check_startd(
        values, site_job_wrapper="/usr/local/libexec/site-wrapper", site_job_exit_hook="/bin/x"
    )
    assert chained == []
    # A different site wrapper than the one named is still reported.
    assert [f.knob for f in check_startd(values, site_job_wrapper="/other")] == [
        "USER_JOB_WRAPPER",
        "SITE_HOOK_JOB_EXIT",
    ]


def test_the_hook_knob_is_read_for_the_keyword_in_use() -> None:
    port = FakeStartdConfig({**SHIPPED, "STARTER_JOB_HOOK_KEYWORD": "SITE"})
    values = read_knobs(port.value)
    assert port.reads == [*KNOBS, "SITE_HOOK_JOB_EXIT"]
    assert values["SITE_HOOK_JOB_EXIT"] is None


def test_a_startd_that_cannot_be_asked_is_skipped_with_the_reason() -> None:
    section = CondorSection()
    failing = FakeStartdConfig({}, error="cannot run condor_config_val: No such file")
    report = check_startd_config(failing, section, 100.0)
    assert report.ok and report.skipped == "cannot run condor_config_val: No such file"
    off = check_startd_config(FakeStartdConfig(SHIPPED), CondorSection(check_startd=False), 1.0)
    assert off.skipped == "[htcondor] check_startd = false" and off.checked_s is None
    site = CondorSection(site_job_wrapper="/usr/local/libexec/site-wrapper")
    values = {**SHIPPED, **OVERRIDES["USER_JOB_WRAPPER"], **OVERRIDES["START"]}
    report = check_startd_config(FakeStartdConfig(values), site, 5.0)
    assert [f.knob for f in report.findings] == ["START"] and report.checked_s == 5.0


def _tool(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "condor_config_val"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return [str(script), "-subsystem", "startd"]


def test_condor_config_val_adapter(tmp_path: Path) -> None:
    """HTCondor 23.9's tool: the value on stdout (exit 0), ``Not defined: NAME`` on
    stderr with exit 1 for an undefined knob; anything else is an error."""
    command = _tool(
        tmp_path,
        'case "$3" in\n'
        '  START) echo "True";;\n'
        '  BROKEN) echo "ERROR: config source is not readable" >&2; exit 1;;\n'
        '  *) echo "Not defined: $3" >&2; exit 1;;\n'
        "esac\n",
    )
    port = CondorConfigVal(command)
    assert port.value("START") == "True"
    assert port.value("USER_JOB_WRAPPER") is None
    with pytest.raises(StartdError, match="config source is not readable"):
        port.value("BROKEN")
    with pytest.raises(StartdError, match="cannot run") as missing:
        CondorConfigVal([str(tmp_path / "nope")]).value("START")
    assert "check_startd = false" in (missing.value.hint or "")


def _status(startd: dict[str, object]) -> dict[str, object]:
    return {
        "node": "n1",
        "daemon": {
            "version": "1",
            "pid": 1,
            "uptime_s": 1.0,
            "backend": "simulated",
            "policy": {"placement": "a", "gpu_choice": "b", "queue": "c", "idle_policy": "d"},
        },
        "gpus": [],
        "queue": [],
        "leases": {},
        "state_disk": {"ok": True, "reason": "", "since_s": None},
        "startd": startd,
    }


def test_status_and_machine_ad_report_a_bypassing_startd() -> None:
    values = {**SHIPPED, **OVERRIDES["START"], **OVERRIDES["MACHINE_RESOURCE_INVENTORY_GPUs"]}
    report = check_startd_config(FakeStartdConfig(values), CondorSection(), 3.0)
    status = _status(report.to_dict())
    ad = render_condor_ad(status)
    assert "MigdStartdOk = false" in ad
    assert 'MigdNodeReason = "startd bypasses migd: MACHINE_RESOURCE_INVENTORY_GPUs = ' in ad
    assert "START = True" in ad
    text = render_status(status)
    assert "WARNING: the startd's configuration bypasses migd (2 knob(s))" in text
    assert "  START = 'True': the start expression does not test MigdHealthy" in text
    good = _status(check_startd_config(FakeStartdConfig(SHIPPED), CondorSection(), 3.0).to_dict())
    assert "MigdStartdOk = true" in render_condor_ad(good)
    assert "startd configuration: runs migd's settings (partitionable)" in render_status(good)
    # An older daemon's status has no "startd": the ad does not claim a problem.
    old = _status({})
    del old["startd"]
    assert "MigdStartdOk = true" in render_condor_ad(old)


@pytest.fixture
def tmp_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="migd-startd-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_daemon_checks_at_start_and_on_reload(tmp_root: Path) -> None:
    """Start: the site's START = True is in status; the site fixes it and reloads: the
    check runs again and the condition clears."""
    from migd.backends.accounts import SystemAccounts
    from migd.backends.procs import PsutilProcessTable
    from migd.backends.simulated import simulated_backend
    from migd.daemon.api.status import build_status
    from migd.daemon.service import Daemon

    def config() -> object:
        return validate_config(
            {
                "daemon": {
                    "state_dir": str(tmp_root / "state"),
                    "runtime_dir": str(tmp_root / "run"),
                },
                "backend": {"kind": "simulated"},
                "api": {"socket": str(tmp_root / "run" / "migd.sock")},
                "htcondor": {"offline_gpus": False},
            }
        )

    port = FakeStartdConfig({**SHIPPED, **OVERRIDES["START"]})
    backend, _ = simulated_backend("1xA100-40GB")

    async def scenario() -> None:
        daemon = Daemon(
            config(),  # type: ignore[arg-type]
            backend,
            PsutilProcessTable(),
            accounts=SystemAccounts(),
            reload_config=config,  # type: ignore[arg-type]
            startd_config=port,
        )
        await daemon.start()
        try:
            await _checked(daemon)
            startd = build_status(daemon.ctx)["startd"]
            assert not startd["ok"] and [p["knob"] for p in startd["problems"]] == ["START"]
            port.values.update(START=SHIPPED["START"])
            reads = len(port.reads)
            assert (await daemon.reload())["reloaded"]
            await _checked(daemon)
            assert len(port.reads) > reads
            assert build_status(daemon.ctx)["startd"]["ok"]
        finally:
            await daemon.close()

    try:
        asyncio.run(scenario())
    finally:
        gc.unfreeze()


async def _checked(daemon: object) -> StartdReport:
    """Wait (10 s at most) for the startd check the daemon started to finish."""
    tasks = [t for t in daemon._tasks if t.get_name() == "startd-check"]  # type: ignore[attr-defined]
    assert tasks, "the daemon started no startd check"
    await asyncio.wait_for(tasks[-1], timeout=10)
    report = daemon.ctx.startd_report  # type: ignore[attr-defined]
    assert report is not None
    return report  # type: ignore[no-any-return]
