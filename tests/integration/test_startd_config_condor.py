"""migd's startd check against HTCondor's own ``condor_config_val`` (issue 24 s3).

migd's execute-node file where the package puts it (``/usr/share/condor/config.d``) and a
site file in ``/etc/condor/config.d`` with ``use FEATURE : GPUs`` and ``START = True``:
HTCondor (Debian trixie's 23.9) reads the site file last, and migd reports both knobs
through the real :class:`~migd.backends.condor.CondorConfigVal` adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from condor_pool import CONDOR_CONFIG_FILE, CondorChroot

from migd.backends.condor import CondorConfigVal
from migd.core.startd_settings import check_startd, read_knobs, slot_layout

REPO = Path(__file__).resolve().parents[2]
SHIPPED = "/usr/share/condor/config.d/10-migd-execute.config"
SITE = "/etc/condor/config.d/50-site-gpus.config"


@pytest.fixture
def migd_config_files(condor_chroot: CondorChroot) -> Iterator[CondorChroot]:
    """migd's execute-node file in place; both files removed again (the chroot is shared).
    An earlier pool test's own file (condor_pool.CONDOR_CONFIG_FILE, written again by the
    next pool) goes first: it may include `migctl condor-slots`, which this chroot's
    config-only install cannot run, and it is not what this test reads."""
    condor_chroot.path(CONDOR_CONFIG_FILE).unlink(missing_ok=True)
    condor_chroot.copy_in(REPO / "condor_config" / "10-migd-execute.config", SHIPPED)
    try:
        yield condor_chroot
    finally:
        for path in (SHIPPED, SITE):
            condor_chroot.path(path).unlink(missing_ok=True)


def _findings(chroot: CondorChroot) -> tuple[dict[str, str | None], list[str]]:
    port = CondorConfigVal(chroot.command(["condor_config_val", "-subsystem", "startd"]))
    values = read_knobs(port.value)
    return values, [f.knob for f in check_startd(values)]


def test_a_site_file_overriding_the_gpu_inventory_and_start_is_reported(
    migd_config_files: CondorChroot,
) -> None:
    chroot = migd_config_files
    values, knobs = _findings(chroot)
    assert knobs == [], values  # migd's file alone: the startd runs migd's settings
    assert slot_layout(values) == "partitionable"
    assert values["USER_JOB_WRAPPER"] == "/usr/bin/migd-wrapper"
    assert "MigdHealthy" in (values["START"] or "")

    chroot.path(SITE).write_text("use FEATURE : GPUs\nSTART = True\n")
    values, knobs = _findings(chroot)
    assert knobs == ["MACHINE_RESOURCE_INVENTORY_GPUs", "START"], values
    assert "condor_gpu_discovery" in (values["MACHINE_RESOURCE_INVENTORY_GPUs"] or "")
    assert values["START"] == "True"

    # The documented way to add a condition keeps migd's expression: not reported.
    chroot.path(SITE).write_text('START = $(START) && (TARGET.Owner =!= "nobody")\n')
    values, knobs = _findings(chroot)
    assert knobs == [], values
