"""Fixtures for the package tests: the .debs (built in the trixie chroot) and the .rpms.

Both are built by ``packaging/build.sh`` once per content hash (see
``tests/integration/migd_packages.py``). The .deb needs the HTCondor chroot harness (root,
debootstrap or the cached tarball): without it these tests fail with the reason, unless
``MIGD_SKIP_HTCONDOR=1``. The .rpm needs ``rpmbuild`` (Debian's ``rpm`` package, which
``scripts/test.sh`` installs): without it the rpm tests are skipped, saying so.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from condor_pool import CondorChroot, session_chroot
from migd_packages import build_debs, build_rpms

SKIP_ENV = "MIGD_SKIP_HTCONDOR"


def _unavailable(reason: str) -> NoReturn:
    message = f"the trixie chroot that builds the .deb is unavailable: {reason}"
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(message)
    pytest.fail(f"{message}\n(set {SKIP_ENV}=1 to skip these tests instead)", pytrace=False)


@pytest.fixture(scope="session")
def trixie_chroot() -> Iterator[CondorChroot]:
    yield from session_chroot(_unavailable)


@pytest.fixture(scope="session")
def debs(trixie_chroot: CondorChroot) -> Path:
    return build_debs(trixie_chroot)


@pytest.fixture(scope="session")
def rpms() -> Path:
    if shutil.which("rpmbuild") is None:
        pytest.skip("rpmbuild is not installed (Debian: apt-get install rpm; scripts/test.sh does)")
    return build_rpms()
