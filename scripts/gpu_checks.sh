#!/usr/bin/env bash
# Every real-GPU check migd has, in one go, for a machine lent for a few minutes.
#
#   scripts/gpu_checks.sh OUT_DIR
#
# Runs, each under a time limit, and never stops at the first failure:
#   1. the machine: nvidia-smi (query options only), driver, MPS binaries, Python;
#      /dev/nvidia-caps (the MIG capability nodes), DCGM's nv-hostengine if it runs;
#   2. scripts/gpu_probe.py (READ-ONLY) -> OUT_DIR/probe.json, as root also what NVML
#      refuses a non-root user (--also-unprivileged; REV1 compute-instance profiles,
#      compute-instance info, processes on MIG devices, MIG memory are in the probe);
#   3. scripts/mig_calibrate.py on GPU 0 -> OUT_DIR/calibrate.json (and, step by step,
#      calibrate.json.steps.jsonl): instance create/destroy, the MIG device handle delay,
#      MIG memory totals and idle use, and (scripts/busy_cuda.py) the destroy of a busy
#      compute instance; it refuses (and changes nothing) unless MIG mode is already on
#      and the GPU is empty. On a MIG-off GPU the log says plainly that every MIG
#      behaviour stays unverified;
#   4. scripts/mps_gpu_check.sh with a private pipe directory -> OUT_DIR/mps/<UTC>-<host>/
#      (MPS client cap, a second user's client with SECOND_USER (as root: default
#      UNPRIVILEGED_USER, else nobody), -M with a non-root
#      client, whether quit waits for a connected client: none of these needs MIG); on a
#      MIG GPU inside a MIG device that scripts/with_mig_instance.py makes and destroys;
#   5. scripts/gpu_daemon_check.sh -> OUT_DIR/daemon/: migd itself, in MIG mode on a MIG
#      GPU (MIGD_MODE=mig), else in MPS mode.
#   6. scripts/systemd_unit_check.sh -> OUT_DIR/systemd/: migd started by the shipped
#      unit (systemd/migd.service, its sandbox included; a runtime copy named
#      migd-gpucheck.service with a drop-in pointing ExecStart at this tree) for one short
#      lease round trip, in the mode of step 5. Where systemd is not PID 1 (containers,
#      most lent machines) it records that it skipped and why (OUT_DIR/systemd/result.txt).
# Then lists any MPS daemon still running, so the log shows that none of ours is left.
# It changes no GPU setting (MIG mode, compute mode, clocks) and never resets a GPU.
# A signal (timeout, ^C, a lost terminal) reaches the step running, which cleans up
# after itself; every step's time limit sends SIGTERM first and SIGKILL 30 s later.
# Results: OUT_DIR/checks.log (everything printed) and the files above.
#
# MIGD_SIMULATE=DESCRIPTION (e.g. "1xA100-40GB") runs the same steps without a GPU: the
# Python scripts on that simulated node, the MPS check against the stand-in control
# daemon, a stand-in nvidia-smi. tests/mps/test_gpu_check_script.py runs it that way.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_checks.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHON  # the shell scripts below run their clients with it
mkdir -p "$OUT"
exec > >(tee -a "$OUT/checks.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}"
sim=()
if [[ -n ${MIGD_SIMULATE:-} ]]; then
  sim=(--simulate "$MIGD_SIMULATE")
  # Stand-ins first on PATH: the fake MPS control daemon and an nvidia-smi that answers
  # the queries the scripts make for the simulated node's GPU 0.
  SIMBIN=$(mktemp -d /tmp/migd-simbin.XXXXXX)
  trap 'rm -rf "$SIMBIN"' EXIT
  "$PYTHON" - "$SIMBIN" "$MIGD_SIMULATE" <<'PY'
import sys
from pathlib import Path
from migd.backends.simulated import SimNode, write_fake_mps_control
bin_dir, description = Path(sys.argv[1]), sys.argv[2]
write_fake_mps_control(bin_dir)
gpu = SimNode.from_description(description).gpus[0]
mig = "Enabled" if gpu.mig_current else "Disabled"
smi = bin_dir / "nvidia-smi"
smi.write_text(
    "#!/bin/sh\n# stand-in nvidia-smi for a simulated node (scripts/gpu_checks.sh)\n"
    'case "$*" in\n'
    f'  *mig.mode.current*) echo "{mig}";;\n'
    f'  *query-gpu=uuid*) echo "{gpu.uuid}";;\n'
    f'  -L) echo "GPU 0: {gpu.spec.name} (UUID: {gpu.uuid})";;\n'
    f'  *) echo "stand-in nvidia-smi (simulated {description}): $*";;\n'
    "esac\n"
)
smi.chmod(0o755)
PY
  PATH="$SIMBIN:$PATH"
fi
# Drivers mounted from the host keep their tools beside nvidia-smi.
smi=$(command -v nvidia-smi || true)
[[ -n $smi ]] && PATH="$PATH:$(dirname "$smi")"

step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

step "1. the machine${MIGD_SIMULATE:+ (SIMULATED: $MIGD_SIMULATE, no GPU)}"
uname -a
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,mig.mode.current,compute_mode,persistence_mode --format=csv
nvidia-smi -L
for b in nvidia-cuda-mps-control nvidia-cuda-mps-server; do
  printf '%s: %s\n' "$b" "$(command -v "$b" || echo missing)"
done
"$PYTHON" -c 'import sys, pynvml, psutil; print(sys.version.split()[0], "nvidia-ml-py", getattr(pynvml, "__version__", "?"))'
pgrep -a nvidia-cuda-mps || echo "no MPS daemon running before the checks"
ls -l /dev/nvidia-caps 2>&1
# DCGM holds NVML handles, which makes a MIG destroy fail "in use" with no process listed
# (DCGM#276, go-nvml#146): record whether it runs, and who has the device files open.
pgrep -a nv-hostengine || echo "no nv-hostengine (DCGM) running"
for fd in /proc/[0-9]*/fd/*; do
  [[ $(readlink "$fd" 2>/dev/null) == /dev/nvidia* ]] && echo "${fd%/fd/*}"
done 2>/dev/null | sort -u | while read -r proc; do
  printf 'has /dev/nvidia* open: %s %s\n' "${proc#/proc/}" "$(tr '\0' ' ' <"$proc/cmdline" 2>/dev/null)"
done
mig=$(nvidia-smi -i 0 --query-gpu=mig.mode.current --format=csv,noheader 2>/dev/null | tr -d ' ')

step "2. gpu_probe.py"
unpriv=()
[[ $(id -u) == 0 && -z ${MIGD_SIMULATE:-} ]] && unpriv=(--also-unprivileged "${UNPRIVILEGED_USER:-nobody}")
timeout -k 30 180 "$PYTHON" "$HERE/gpu_probe.py" "${sim[@]}" "${unpriv[@]}" -o "$OUT/probe.json"
echo "[gpu_probe exit $?]"

if [[ $mig == Enabled ]]; then
  step "2b. gpu_probe.py with one MIG instance made for it"
  # REV1 compute-instance profiles, what compute-instance info names, processes on MIG
  # devices and MIG memory need an instance; with_mig_instance.py destroys it afterwards.
  timeout -k 60 180 "$PYTHON" "$HERE/with_mig_instance.py" "${sim[@]}" --gpu 0 -- \
    "$PYTHON" "$HERE/gpu_probe.py" "${sim[@]}" "${unpriv[@]}" -o "$OUT/probe_with_instance.json"
  echo "[gpu_probe with an instance exit $?]"
fi

step "3. mig_calibrate.py --gpu 0"
if [[ $mig != Enabled ]]; then
  echo "MIG mode is ${mig:-unknown} on GPU 0 and is never changed here: MIG instance"
  echo "create/destroy, MIG device handles, busy destroys, MIG memory, /dev/nvidia-caps and"
  echo "MPS inside MIG all STAY UNVERIFIED on this machine (mig_calibrate.py will refuse)."
fi
timeout -k 30 240 "$PYTHON" "$HERE/mig_calibrate.py" "${sim[@]}" --gpu 0 -o "$OUT/calibrate.json" \
  --busy-command "$PYTHON $HERE/busy_cuda.py 256"
echo "[mig_calibrate exit $?]"

step "4. mps_gpu_check.sh"
if [[ $(id -u) == 0 && -z ${MIGD_SIMULATE:-} ]]; then
  # A second user's client (7c) and -M with a non-root client (11) need a second user;
  # the H100 run (2026-11-28) used nobody with the first user's Python.
  export SECOND_USER=${SECOND_USER:-${UNPRIVILEGED_USER:-nobody}}
  export SECOND_PYTHON=${SECOND_PYTHON:-$(command -v "$PYTHON")}
fi
if [[ $mig == Enabled && -z ${GPU_UUID:-} ]]; then
  # MPS inside MIG: a MIG device of its own for the check, destroyed afterwards (on
  # every signal too); the GPU must be empty, as for mig_calibrate.
  echo "GPU 0 is in MIG mode: MPS inside a MIG device made for the check"
  timeout -k 60 300 "$PYTHON" "$HERE/with_mig_instance.py" "${sim[@]}" --gpu 0 \
    -- bash "$HERE/mps_gpu_check.sh" "$OUT/mps"
  echo "[mps_gpu_check in a MIG device exit $?]"
else
  PYTHON=$PYTHON timeout -k 30 300 bash "$HERE/mps_gpu_check.sh" "$OUT/mps"
  echo "[mps_gpu_check exit $?]"
fi

step "5. gpu_daemon_check.sh (migd itself)"
daemon_mode=mps
[[ $mig == Enabled ]] && daemon_mode=mig
MIGD_MODE=$daemon_mode PYTHON=$PYTHON timeout -k 30 300 bash "$HERE/gpu_daemon_check.sh" "$OUT/daemon"
echo "[gpu_daemon_check ($daemon_mode) exit $?]"

step "6. systemd_unit_check.sh (migd under the shipped unit)"
MIGD_MODE=$daemon_mode PYTHON=$PYTHON timeout -k 30 300 bash "$HERE/systemd_unit_check.sh" "$OUT/systemd"
echo "[systemd_unit_check ($daemon_mode) exit $?]"

step "after"
pgrep -a nvidia-cuda-mps || echo "no MPS daemon left running"
ls -lR "$OUT"
