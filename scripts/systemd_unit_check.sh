#!/usr/bin/env bash
# migd started by the shipped systemd unit (systemd/migd.service), with its sandbox, for
# one short lease round trip on GPU 0.
#
#   scripts/systemd_unit_check.sh OUT_DIR
#
# Where systemd is PID 1 and this runs as root, it installs the unit from this tree as a
# runtime unit of its own name (/run/systemd/system/migd-gpucheck.service: gone at reboot,
# never the machine's migd.service) with one drop-in that points ExecStart at this tree's
# Python (its venv) and gives the unit its own state, runtime and config paths; every other
# line, the sandbox included, is the shipped unit's. It then starts it (Type=notify: the
# start returns once migd said READY=1), runs one job through the wrapper on a 1 GiB share
# (mode MIGD_MODE, default mps), records `migctl status`, the unit's sandbox settings and
# its journal, and stops it. Where systemd is not PID 1 (containers, most lent machines),
# or not as root, or in a simulated run, or while a migd.service is active (two migds
# must not manage one GPU), it installs nothing and records that it skipped and why.
# It changes no GPU setting (MIG mode, compute mode, clocks). On every exit and signal it
# stops the unit and the MPS daemon scopes migd started under it, and removes the unit,
# its drop-in, its config and its state.
# Results: OUT_DIR/systemd_check.log, result.txt ("ok", "failed: ..." or "skipped: ..."),
# unit/ (the unit and drop-in as installed, or as they would have been), status.json,
# show.txt, journal.txt.
set -uo pipefail
OUT=${1:?usage: scripts/systemd_unit_check.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TREE=$(cd "$HERE/.." && pwd)
PYTHON=${PYTHON:-python3}
MODE=${MIGD_MODE:-mps}
UNIT=migd-gpucheck
UNIT_DIR=${MIGD_UNIT_DIR:-/run/systemd/system}
# Tests only: MIGD_SYSTEMD_CHECK_PREFIX puts the runtime, state and config paths under a
# directory of their own, and MIGD_SYSTEMD_CHECK_ASSUME=1 skips the PID 1 and root checks
# (tests/mps/test_gpu_check_script.py runs it so with a recording systemctl on PATH).
PREFIX=${MIGD_SYSTEMD_CHECK_PREFIX:-}
RUN=$PREFIX/run/$UNIT
STATE=$PREFIX/var/lib/$UNIT
CONF_DIR=$PREFIX/run/$UNIT-conf
SOCK=$RUN/migd.sock
mkdir -p "$OUT/unit"
# tee ignores the signals a `timeout` sends the whole group, so the clean-up's lines still
# reach the log (and the clean-up is not killed by SIGPIPE writing them).
exec > >(trap '' TERM INT HUP; exec tee -a "$OUT/systemd_check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"

result() { printf '%s\n' "$1" >"$OUT/result.txt"; echo "RESULT: $1"; }

# The interpreter as this tree runs it: absolute, but not resolved through its symlink (a
# venv's python is a link to the system one; resolving it would lose the venv).
py=$(command -v "$PYTHON" || true)
[[ -n $py && $py != /* ]] && py="$PWD/$py"
cat >"$OUT/unit/$UNIT.conf" <<EOF
# Drop-in for $UNIT.service (a copy of this tree's systemd/migd.service): run migd from
# the tree, with paths of its own; the sandbox is the shipped unit's.
[Service]
ExecStart=
ExecStart=${py:-python3} -m migd --config $CONF_DIR/migd.toml
Environment=PYTHONPATH=$TREE
RuntimeDirectory=
RuntimeDirectory=$UNIT
StateDirectory=
StateDirectory=$UNIT
EOF
for path in "$TREE" "$py"; do
  case "$path" in
    /tmp/* | /var/tmp/*)
      # PrivateTmp=yes would hide the tree: the one sandbox line this run changes.
      printf 'PrivateTmp=no\n' >>"$OUT/unit/$UNIT.conf"
      echo "note: $path is under /tmp, so the drop-in sets PrivateTmp=no"
      break
      ;;
  esac
done
cp "$TREE/systemd/migd.service" "$OUT/unit/$UNIT.service"

pid1=$(cat /proc/1/comm 2>/dev/null || echo unknown)
why=""
assume=${MIGD_SYSTEMD_CHECK_ASSUME:-}
if [[ -z $assume && ($pid1 != systemd || ! -d /run/systemd/system) ]]; then
  why="systemd is not PID 1 (PID 1 is $pid1): migd under systemd/migd.service stays unverified here"
elif [[ -n ${MIGD_SIMULATE:-} ]]; then
  why="a simulated run installs no unit on this host"
elif [[ -z $assume && $(id -u) != 0 ]]; then
  why="not root: installing and starting a system unit needs root"
elif ! command -v systemctl >/dev/null; then
  why="no systemctl"
elif [[ -z $py ]]; then
  why="no $PYTHON to run migd with"
elif systemctl is-active --quiet migd.service; then
  why="migd.service is active here: a second migd must not manage the same GPUs"
fi
if [[ -n $why ]]; then
  echo "SKIPPED: $why"
  result "skipped: $why"
  exit 0
fi

installed=0
child=""
# waited CMD...: run CMD in the background and wait for it, so that a signal runs the
# clean-up at once (bash runs a trap only after a foreground command ends, and `timeout`
# puts its command in a process group of its own, out of reach of a group-wide signal).
waited() {
  "$@" &
  child=$!
  wait "$child"
  local rc=$?
  child=""
  return "$rc"
}
cleanup() {
  trap - EXIT INT TERM HUP
  if [[ -n $child ]]; then
    kill -TERM "$child" 2>/dev/null
    wait "$child" 2>/dev/null
  fi
  ((installed)) || return
  echo "cleanup: stopping $UNIT and the MPS daemons it started"
  # The MPS daemons run in scopes of their own (they outlive migd by design); their
  # records are under the runtime directory, which stopping the unit removes.
  scopes=$("$PYTHON" - "$RUN/mps" <<'PY' 2>/dev/null
import json, sys
from pathlib import Path
for record in Path(sys.argv[1]).glob("*/migd-mps.json"):
    unit = json.loads(record.read_text()).get("scope_unit") or ""
    if unit:
        print(unit)
PY
)
  timeout 90 systemctl stop "$UNIT.service"
  for scope in $scopes; do
    timeout 30 systemctl stop "$scope" 2>/dev/null
  done
  systemctl reset-failed "$UNIT.service" 2>/dev/null
  rm -rf "$UNIT_DIR/$UNIT.service" "$UNIT_DIR/$UNIT.service.d" "$CONF_DIR" "$STATE"
  systemctl daemon-reload
  systemctl is-active "$UNIT.service" || true
  pgrep -a nvidia-cuda-mps || echo "no MPS daemon left running"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

printf '\n== migd under %s.service (mode %s, %s)\n' "$UNIT" "$MODE" "$(date -u +%H:%M:%S)"
installed=1
mkdir -p "$CONF_DIR" "$UNIT_DIR/$UNIT.service.d"
cat >"$CONF_DIR/migd.toml" <<EOF
version = 1
[daemon]
state_dir = "$STATE"
runtime_dir = "$RUN"
log_format = "json"
[api]
socket = "$SOCK"
[htcondor]
offline_gpus = false
[[gpu]]
match = "0"
mode = "$MODE"
EOF
cp "$OUT/unit/$UNIT.service" "$UNIT_DIR/$UNIT.service"
cp "$OUT/unit/$UNIT.conf" "$UNIT_DIR/$UNIT.service.d/tree.conf"
systemctl daemon-reload
if ! waited timeout 120 systemctl start "$UNIT.service"; then
  systemctl status --no-pager "$UNIT.service"
  journalctl -u "$UNIT.service" --no-pager -n 200 >"$OUT/journal.txt" 2>&1
  result "failed: $UNIT.service did not start (journal.txt)"
  exit 1
fi
systemctl show "$UNIT.service" -p ActiveState -p SubState -p MainPID -p NRestarts \
  -p User -p NoNewPrivileges -p ProtectSystem -p ProtectHome -p PrivateTmp \
  -p ProtectKernelTunables -p ProtectControlGroups -p RestrictSUIDSGID -p WatchdogUSec \
  -p ControlGroup | tee "$OUT/show.txt"

# One job through the wrapper: lease, MPS daemon (in its scope), the job's environment,
# release. With PyTorch it allocates 256 MiB on its share.
waited timeout 120 "$PYTHON" -m migd.wrapper.main --socket "$SOCK" --gpu-memory 1G --mode "$MODE" \
  --job-id sd.1 -- "$PYTHON" -c '
import os
print("job env:", {k: v for k, v in os.environ.items() if k.startswith("CUDA_")}, flush=True)
try:
    import torch
except ImportError:
    raise SystemExit(0)
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
print("allocated 256 MiB under the unit", flush=True)
'
job=$?
echo "[job sd.1 exit $job]"
"$PYTHON" -m migd.cli.migctl --socket "$SOCK" status --json >"$OUT/status.json"
"$PYTHON" -m migd.cli.migctl --socket "$SOCK" status
systemctl status --no-pager "$UNIT.service"
timeout 90 systemctl stop "$UNIT.service"
stopped=$(systemctl show "$UNIT.service" -p Result -p ExecMainStatus | tr '\n' ' ')
echo "stopped: $stopped"
journalctl -u "$UNIT.service" --no-pager -n 400 >"$OUT/journal.txt" 2>&1
if [[ $job == 0 && $stopped == *Result=success* ]]; then
  result "ok: lease round trip under $UNIT.service; $stopped"
else
  result "failed: job exit $job; $stopped"
fi
