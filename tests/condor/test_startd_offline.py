"""StartdOffline: the offline file the shipped HTCondor config includes, and condor_reconfig.

HTCondor's tools are stand-in scripts here (no HTCondor on the test host; the real startd
reading the file is tests/integration/test_gpu_failure_pool.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from migd.backends.condor import StartdOffline
from migd.core.condor_shares import FALLBACK_SHARES
from migd.errors import StartdError

GPU_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
GPU_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"


def tool(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def startd(tmp_path: Path) -> StartdOffline:
    log = tmp_path / "reconfig.log"
    return StartdOffline(
        tmp_path / "condor-offline-gpus.config",
        reconfig=(tool(tmp_path, "reconfig", f'echo "$*" >> {log}'), "-daemon", "startd"),
        config_val=(tool(tmp_path, "config_val", "echo 3"), "MIGD_SHARES_PER_GPU"),
    )


def reconfigs(startd: StartdOffline) -> list[str]:
    log = startd.path.parent / "reconfig.log"
    return log.read_text().splitlines() if log.exists() else []


def test_the_shares_of_each_offline_gpu_are_written_and_the_startd_reconfigured(
    startd: StartdOffline,
) -> None:
    ids = startd.set_offline_gpus([GPU_A, GPU_B])
    assert ids == [f"GPU-s0{n}-{g}" for g in ("aaaaaaaa", "bbbbbbbb") for n in range(3)]
    text = startd.path.read_text()
    assert text.splitlines()[-1] == (
        "OFFLINE_MACHINE_RESOURCE_GPUs = $(OFFLINE_MACHINE_RESOURCE_GPUs) " + ", ".join(ids)
    )
    assert all(line.startswith("#") for line in text.splitlines()[:-1])
    assert startd.path.stat().st_mode & 0o777 == 0o644
    assert reconfigs(startd) == ["-daemon startd"]
    # back in service: the list is emptied and the startd told again
    assert startd.set_offline_gpus([]) == []
    assert "OFFLINE_MACHINE_RESOURCE_GPUs" not in startd.path.read_text()
    assert reconfigs(startd) == ["-daemon startd"] * 2


def test_nothing_is_run_when_the_file_already_says_it(startd: StartdOffline) -> None:
    assert startd.set_offline_gpus([]) == []  # no file, nothing offline: a normal start
    assert not startd.path.exists() and reconfigs(startd) == []
    startd.set_offline_gpus([GPU_A])
    startd.set_offline_gpus([GPU_A])  # a restarted migd with the same verdict
    assert reconfigs(startd) == ["-daemon startd"]


def test_unknown_shares_per_gpu_lists_the_most_the_startd_may_know(
    startd: StartdOffline, tmp_path: Path
) -> None:
    startd.config_val = (tool(tmp_path, "no_config", "echo 'Not defined' >&2; exit 1"),)
    assert len(startd.set_offline_gpus([GPU_A])) == FALLBACK_SHARES


def test_a_failing_reconfig_says_what_htcondor_said(startd: StartdOffline, tmp_path: Path) -> None:
    startd.reconfig = (
        tool(tmp_path, "refused", 'echo "ERROR: Can\'t connect to startd" >&2; exit 1'),
    )
    with pytest.raises(StartdError, match="Can't connect to startd") as err:
        startd.set_offline_gpus([GPU_A])
    assert "condor_reconfig" in err.value.hint
    # the file says what migd wants: the startd reads it when it starts
    assert "GPU-s00-aaaaaaaa" in startd.path.read_text()
    # the retry reconfigures although the file is already right
    startd.reconfig = (tool(tmp_path, "works", f'echo "$*" >> {tmp_path / "reconfig.log"}'),)
    startd.set_offline_gpus([GPU_A])
    assert reconfigs(startd) == [""]


def test_a_missing_or_hanging_tool_is_an_error_not_a_hang(
    startd: StartdOffline, tmp_path: Path
) -> None:
    startd.reconfig = (str(tmp_path / "no-such-condor_reconfig"),)
    with pytest.raises(StartdError, match="cannot run"):
        startd.set_offline_gpus([GPU_A])
    startd.reconfig = (tool(tmp_path, "hang", "exec sleep 60"),)
    startd.timeout_s = 0.5
    with pytest.raises(StartdError, match=r"did not finish within 0\.5 s"):
        startd.set_offline_gpus([GPU_B])


def test_an_unwritable_file_is_an_error(startd: StartdOffline, tmp_path: Path) -> None:
    startd.path = tmp_path / "no-such-dir" / "offline.config"
    with pytest.raises(StartdError, match="cannot write"):
        startd.set_offline_gpus([GPU_A])
    assert reconfigs(startd) == []
