"""Fixtures for integration tests against a real HTCondor personal pool.

``condor_chroot`` (session): the Debian trixie chroot with HTCondor, built or
restored from the cache once, mounted for the session and cleaned up (all
processes killed, everything unmounted) at the end.

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
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from condor_pool import (
    CondorChroot,
    HarnessUnavailable,
    PersonalPool,
    default_cache,
    default_root,
)

SKIP_ENV = "MIGD_SKIP_HTCONDOR"
_HARNESS_FIXTURES = {"condor_chroot", "personal_pool"}


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


def _unavailable(reason: str) -> None:
    message = f"HTCondor integration harness unavailable: {reason}"
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(message)
    pytest.fail(f"{message}\n(set {SKIP_ENV}=1 to skip these tests instead)", pytrace=False)


@pytest.fixture(scope="session")
def condor_chroot() -> Iterator[CondorChroot]:
    chroot = CondorChroot(default_root())
    try:
        chroot.check_host()
        chroot.ensure_built(default_cache())
    except HarnessUnavailable as exc:
        _unavailable(str(exc))
    chroot.mount()
    try:
        yield chroot
    finally:
        chroot.cleanup()


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
