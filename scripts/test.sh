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

# Debian's packages the tests use, installed where missing (root only):
# debootstrap builds the HTCondor chroot (tests/integration), rpm's rpmbuild the .rpm
# (tests/packaging), shellcheck checks scripts/mps_gpu_check.sh, a real Prometheus
# scrapes a simulated node (tests/metrics/test_scrape.py) and its promtool checks the shipped
# alert rules (tests/metrics/test_alert_rules.py), and systemd-nspawn boots the chroot with
# systemd as PID 1 to run the shipped unit (tests/integration/test_systemd_unit.py); each
# skips, saying why, without its package.
missing=()
for pair in debootstrap:debootstrap rpmbuild:rpm shellcheck:shellcheck prometheus:prometheus \
    systemd-nspawn:systemd-container; do
    command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null; } || echo "could not install ${missing[*]}: their tests say why they skip"
fi

lint() {
    echo "== ruff"; .venv/bin/ruff check .
    echo "== ruff format"; .venv/bin/ruff format --check .
    echo "== mypy (strict)"; .venv/bin/mypy
}
if [ $# -gt 0 ]; then
    lint
    echo "== pytest"
    exec .venv/bin/python -m pytest "$@"
fi
# The whole suite waits on processes, sockets and HTCondor far more than it computes, so
# it runs as three overlapping pytest runs: the chroot tiers (the HTCondor pools and the
# packages) in two processes, each with a Debian chroot of its own (a chroot runs one pool
# at a time; the second is restored from the first one's cache), and everything else on
# pytest-xdist workers beside them. The chroot tiers are the longest part, so they start
# first, while the lint and type checks run.
root=${MIGD_CONDOR_ROOT:-/var/tmp/migd-condor-chroot}
lane_a=(tests/integration/test_condor_pool.py tests/integration/test_condor_gpu_language.py
    tests/packaging)
lane_b=(tests/integration --ignore=tests/integration/test_condor_pool.py
    --ignore=tests/integration/test_condor_gpu_language.py)
log_a=$(mktemp) log_b=$(mktemp) rest_log=$(mktemp)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            # SIGTERM: tests/conftest.py turns it into pytest's Ctrl-C, whose teardown unmounts
            # the chroot (a background job of a script ignores SIGINT itself).
            kill -TERM "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
        fi
    done
    rm -f "$log_a" "$log_b" "$rest_log"
}
trap cleanup EXIT
MIGD_CONDOR_ROOT=$root .venv/bin/python -m pytest -p no:cacheprovider "${lane_a[@]}" \
    >"$log_a" 2>&1 &
pids+=($!)
MIGD_CONDOR_ROOT=$root-2 .venv/bin/python -m pytest -p no:cacheprovider "${lane_b[@]}" \
    >"$log_b" 2>&1 &
pids+=($!)
lint
echo "== pytest"
rest=0
.venv/bin/python -m pytest -p no:cacheprovider -n 3 \
    --ignore=tests/integration --ignore=tests/packaging 2>&1 | tee "$rest_log" || rest=$?
chroot=0
for pid in "${pids[@]}"; do
    wait "$pid" || chroot=1
done
pids=()
echo "== pytest: the chroot tiers (in $root: ${lane_a[*]})"
cat "$log_a"
echo "== pytest: the chroot tiers (in $root-2: tests/integration, the other files)"
cat "$log_b"
# One closing line for all runs, in pytest's words ("N passed, N failed, N skipped").
.venv/bin/python - "$rest_log" "$log_a" "$log_b" <<'PY'
import re
import sys

totals = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
for path in sys.argv[1:]:
    lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    summary = next((x for x in reversed(lines) if re.search(r"\d+ (passed|failed|error)", x)), "")
    for count, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", summary):
        totals["errors" if word.startswith("error") else word] += int(count)
failed = totals["failed"] + totals["errors"]
print(f"{totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
PY
[ "$rest" = 0 ] && [ "$chroot" = 0 ]
