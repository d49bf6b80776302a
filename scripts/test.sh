#!/usr/bin/env bash
# Set up a virtual environment and run everything CI runs: lint, formatting, strict types and
# the whole test suite (unit, property-based, process-level, and the real HTCondor 23.9 pool
# in a Debian trixie chroot, which needs root and debootstrap; it is built once and cached in
# ~/.cache/migd). Extra arguments go to pytest, e.g. `scripts/test.sh -k wrapper -x`.
#
# The fast subset for the edit-test loop (under a minute on 2 cores; no root, no chroot):
#     .venv/bin/python -m pytest -m "not slow and not htcondor"
# or, with the lint and type checks first, `scripts/test.sh -m "not slow and not htcondor"`.
# `htcondor` marks the real-pool tests (tests/integration); `slow` marks the process tier
# (tests/process, by tests/conftest.py) and the tests marked where they are defined.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,sim]'

# The integration tests build a chroot with debootstrap (Debian's package, root only).
if ! command -v debootstrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi
# tests/packaging builds the .rpm with rpmbuild (Debian's rpm package).
if ! command -v rpmbuild >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rpm >/dev/null
fi

# tests/metrics/test_scrape.py scrapes a simulated node with a real Prometheus (Debian's
# package); it is skipped, saying why, where the package cannot be installed.
if ! command -v prometheus >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
        || echo "prometheus could not be installed: tests/metrics/test_scrape.py's Prometheus test is skipped"
fi

echo "== ruff"; .venv/bin/ruff check .
echo "== ruff format"; .venv/bin/ruff format --check .
echo "== mypy (strict)"; .venv/bin/mypy
echo "== pytest"; .venv/bin/python -m pytest "$@"
