"""Fixtures for integration tests against a real HTCondor personal pool.

``condor_chroot`` (session): the Debian trixie chroot with HTCondor, built or
restored from the cache once, mounted for the session and cleaned up (all
processes killed, everything unmounted) at the end.

``migd_debs`` (session): the directory (host path) holding this tree's migd, migd-ep and
migd-ap ``.deb`` files, built with ``packaging/build.sh`` inside the chroot once per
content hash (``tests/integration/migd_packages.py``).

``migd_installed`` (module): the chroot with those packages installed the way the README
tells an admin (``apt-get install ./migd_*.deb ./migd-ep_*.deb ./migd-ap_*.deb``), purged
again after the module so that other modules see a plain HTCondor.

``personal_pool`` (function): a factory ``personal_pool(extra_config="", *,
name=None, config_files=None, timeout=60)`` that starts a fresh pool; every
pool it made is stopped after the test, and on failure its logs are printed.

Tests using these fixtures are marked ``htcondor``.  When the harness cannot
run here (not root, no debootstrap, no Debian mirror) they fail with the reason,
unless ``MIGD_SKIP_HTCONDOR=1`` is set, in which case they are skipped.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import NoReturn

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from condor_pool import (
    CondorChroot,
    PersonalPool,
    _log,
    session_chroot,
)
from migd_packages import MIGD_PYTHON, build_debs, ensure_apt_lists

SKIP_ENV = "MIGD_SKIP_HTCONDOR"
_HARNESS_FIXTURES = {"condor_chroot", "personal_pool", "migd_debs", "migd_installed"}
MIGD_PACKAGES = ("migd", "migd-ep", "migd-ap")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "htcondor: needs the real HTCondor personal pool in a Debian chroot "
        f"(root, debootstrap, Debian mirror; set {SKIP_ENV}=1 to skip when unavailable)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HARNESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.htcondor)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    setattr(item, f"_migd_rep_{report.when}", report)
    return report


def _unavailable(reason: str) -> NoReturn:
    message = f"HTCondor integration harness unavailable: {reason}"
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(message)
    pytest.fail(f"{message}\n(set {SKIP_ENV}=1 to skip these tests instead)", pytrace=False)


@pytest.fixture(scope="session")
def condor_chroot() -> Iterator[CondorChroot]:
    yield from session_chroot(_unavailable)


@pytest.fixture(scope="session")
def migd_debs(condor_chroot: CondorChroot) -> Path:
    return build_debs(condor_chroot)


def purge_migd(chroot: CondorChroot) -> None:
    """dpkg --purge the migd packages (those installed), as an admin removing migd would."""
    chroot.run(["dpkg", "--purge", *MIGD_PACKAGES], check=False, timeout=120)


def install_migd(
    chroot: CondorChroot, debs: Path, packages: tuple[str, ...] = MIGD_PACKAGES
) -> float:
    """``apt-get install ./<package>_*.deb`` inside the chroot; returns the seconds it took."""
    chroot.run(["rm", "-rf", "/tmp/migd-debs"])
    names = []
    for pkg in packages:
        [deb] = sorted(debs.glob(f"{pkg}_*.deb"))
        chroot.copy_in(deb, f"/tmp/migd-debs/{deb.name}")
        names.append(f"./{deb.name}")
    ensure_apt_lists(chroot)  # migd's Depends come from Debian's archive
    t0 = time.monotonic()
    chroot.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *names],
        env={"DEBIAN_FRONTEND": "noninteractive"},
        cwd="/tmp/migd-debs",
        timeout=300,
    )
    took = time.monotonic() - t0
    _log(f"apt-get install {' '.join(names)}: {took:.1f}s")
    # The tests' fake CUDA job is a module of migd (migd.backends.simulated.cuda_job): run
    # it with the packaged migd's interpreter and its private directory on the path.
    chroot.write_file(
        MIGD_PYTHON,
        '#!/bin/sh\nexec env PYTHONPATH=/usr/lib/migd /usr/bin/python3 "$@"\n',
        mode=0o755,
    )
    return took


@pytest.fixture(scope="module")
def migd_installed(condor_chroot: CondorChroot, migd_debs: Path) -> Iterator[CondorChroot]:
    purge_migd(condor_chroot)  # an earlier session's build of the same version
    install_migd(condor_chroot, migd_debs)
    try:
        yield condor_chroot
    finally:
        purge_migd(condor_chroot)


def _failed(node: pytest.Item) -> bool:
    return any(
        getattr(getattr(node, f"_migd_rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


PoolFactory = Callable[..., PersonalPool]


@pytest.fixture
def personal_pool(
    condor_chroot: CondorChroot, request: pytest.FixtureRequest
) -> Iterator[PoolFactory]:
    pools: list[PersonalPool] = []
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)[:60]

    def factory(
        extra_config: str = "",
        *,
        name: str | None = None,
        config_files: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> PersonalPool:
        pool_name = name or (base if not pools else f"{base}-{len(pools) + 1}")
        pool = PersonalPool(condor_chroot, pool_name)
        pools.append(pool)
        pool.start(extra_config, config_files=config_files, timeout=timeout)
        return pool

    try:
        yield factory
    finally:
        for pool in pools:
            if _failed(request.node):
                print(pool.dump_logs())
            pool.stop()
