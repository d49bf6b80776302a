"""Build migd's packages with ``packaging/build.sh`` once per content, for the tests.

The ``.deb`` is built inside the trixie chroot (its python3 and Debian's Python packages
run migd's parsers for the man pages, as on a real trixie build machine); the ``.rpm`` on
the host with ``rpmbuild``. The .deb depends on Debian's packages, so installing it needs
the chroot's apt lists (:func:`ensure_apt_lists`; the cached chroot has none). Both are cached in
``$MIGD_PACKAGE_CACHE`` (default ``~/.cache/migd/packages``) under a hash of everything
that goes into them, so a test session rebuilds only after a change to the code, the
packaging or the shipped configuration.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from condor_pool import RECIPE, ChrootCommandError, CondorChroot, _flock, _log

REPO = Path(__file__).resolve().parents[2]
# What goes into a package: the code, the packaging, and the files it ships.
INPUTS = (
    "migd",
    "packaging",
    "condor_config",
    "systemd",
    "contrib",
    "pyproject.toml",
    "README.md",
    "docs",
)
KEEP = 4  # cached builds kept per kind
# Fast compression for the rpm (its vendored wheels: w19 takes tens of seconds on a 2-core
# machine); the .deb is a release build (xz, what lintian accepts; about 2.5 MB to compress).
BUILD_ENV = {"RPM_PAYLOAD": "w3.zstdio"}


# Written by tests/integration/conftest.py:install_migd: python3 with the packaged migd's
# private directory on its path, for the tests' fake CUDA job (a module of migd).
MIGD_PYTHON = "/usr/local/bin/migd-test-python"

# What the .deb build runs migd with (the man pages come from its parsers); also the .deb's
# Depends besides condor and python3.
BUILD_DEPS = (
    "python3-pydantic",
    "python3-structlog",
    "python3-prometheus-client",
    "python3-psutil",
)


def ensure_apt_lists(chroot: CondorChroot) -> None:
    """``apt-get update`` in the chroot unless it has package lists: the cached chroot is
    saved without them, and ``apt-get install ./migd_*.deb`` resolves migd's Depends
    (python3-pydantic, ...) from Debian's archive."""
    lists = chroot.path("var/lib/apt/lists")
    if not any(lists.glob("*_Packages*")):
        chroot.run(
            ["apt-get", "update", "-q"], env={"DEBIAN_FRONTEND": "noninteractive"}, timeout=600
        )


def install_build_deps(chroot: CondorChroot) -> None:
    ensure_apt_lists(chroot)
    chroot.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *BUILD_DEPS],
        env={"DEBIAN_FRONTEND": "noninteractive"},
        timeout=600,
    )


def package_cache() -> Path:
    env = os.environ.get("MIGD_PACKAGE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "migd" / "packages"


def content_hash(extra: str = "") -> str:
    """sha256 over the package inputs (paths and bytes), skipping caches and bytecode."""
    h = hashlib.sha256(extra.encode())
    for top in INPUTS:
        base = REPO / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for f in files:
            rel = f.relative_to(REPO)
            if "__pycache__" in rel.parts or f.suffix == ".pyc":
                continue
            h.update(str(rel).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _prune(kind_dir: Path) -> None:
    builds = sorted((d for d in kind_dir.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for old in builds[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def _cached(kind: str, key: str, pattern: str) -> Path | None:
    done = package_cache() / kind / key
    if (done / ".complete").is_file() and list(done.glob(pattern)):
        return done
    return None


def build_debs(chroot: CondorChroot) -> Path:
    """Host directory with migd, migd-ep and migd-ap .debs for this tree (built if needed).

    ``chroot`` must be mounted: build.sh runs inside it as root, with apt and pip (for the
    vendored nvidia-ml-py) reaching their archives through the host's network settings.
    """
    key = content_hash(RECIPE + repr(BUILD_ENV))
    kind_dir = package_cache() / "deb"
    with _flock(kind_dir / ".lock"):
        hit = _cached("deb", key, "migd_*.deb")
        if hit is not None:
            return hit
        src, out = "/opt/migd-pkg-src", "/opt/migd-pkg-out"
        chroot.run(["rm", "-rf", src, out])
        chroot.copy_in(
            REPO,
            src,
            ignore=(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".*_cache"),
        )
        install_build_deps(chroot)
        t0 = time.monotonic()
        try:
            chroot.run(
                ["bash", f"{src}/packaging/build.sh", "deb", out],
                env={**chroot.pip_env(), **BUILD_ENV},
                timeout=900,
            )
        except ChrootCommandError as exc:
            raise RuntimeError(f"packaging/build.sh deb failed in the chroot:\n{exc}") from None
        _log(f"built the .debs in the chroot in {time.monotonic() - t0:.1f}s")
        return _store(
            kind_dir,
            key,
            chroot.path(out),
            "*.deb",
            cleanup=lambda: chroot.run(["rm", "-rf", src, out]),
        )


def build_rpms() -> Path:
    """Host directory with migd, migd-ep and migd-ap .rpms for this tree (built if needed)."""
    key = content_hash(repr(BUILD_ENV))
    kind_dir = package_cache() / "rpm"
    with _flock(kind_dir / ".lock"):
        hit = _cached("rpm", key, "migd-*.rpm")
        if hit is not None:
            return hit
        tmp = kind_dir / f".build-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        proc = subprocess.run(
            ["bash", str(REPO / "packaging" / "build.sh"), "rpm", str(tmp)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
            env={**os.environ, **BUILD_ENV},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"packaging/build.sh rpm failed:\n{proc.stdout}\n{proc.stderr}")
        _log(f"built the .rpms in {time.monotonic() - t0:.1f}s")
        return _store(kind_dir, key, tmp, "*.rpm", cleanup=lambda: shutil.rmtree(tmp))


def _store(
    kind_dir: Path, key: str, built: Path, pattern: str, cleanup: Callable[[], object]
) -> Path:
    done = kind_dir / key
    shutil.rmtree(done, ignore_errors=True)
    done.mkdir(parents=True)
    for f in built.glob(pattern):
        shutil.copy2(f, done / f.name)
    (done / ".complete").write_text(key + "\n", encoding="utf-8")
    with contextlib.suppress(Exception):
        cleanup()
    _prune(kind_dir)
    return done
