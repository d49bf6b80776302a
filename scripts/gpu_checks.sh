#!/usr/bin/env bash
# Every real-GPU check migd has, in one go, for a machine lent for a few minutes.
#
#   scripts/gpu_checks.sh OUT_DIR
#
# Runs, each under a time limit, and never stops at the first failure:
#   1. the machine: nvidia-smi (query options only), driver, MPS binaries, Python;
#   2. scripts/gpu_probe.py (READ-ONLY) -> OUT_DIR/probe.json;
#   3. scripts/mig_calibrate.py on GPU 0 -> OUT_DIR/calibrate.json; it refuses (and changes
#      nothing) unless MIG mode is already on and the GPU is empty;
#   4. scripts/mps_gpu_check.sh with a private pipe directory -> OUT_DIR/mps/<UTC>-<host>/.
# Then lists any MPS daemon still running, so the log shows that none of ours is left.
# It changes no GPU setting (MIG mode, compute mode, clocks) and never resets a GPU.
# Results: OUT_DIR/checks.log (everything printed) and the files above.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_checks.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/checks.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}"
# Drivers mounted from the host keep their tools beside nvidia-smi.
smi=$(command -v nvidia-smi || true)
[[ -n $smi ]] && PATH="$PATH:$(dirname "$smi")"

step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

step "1. the machine"
uname -a
nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.total,mig.mode.current,compute_mode,persistence_mode --format=csv
nvidia-smi -L
for b in nvidia-cuda-mps-control nvidia-cuda-mps-server; do
  printf '%s: %s\n' "$b" "$(command -v "$b" || echo missing)"
done
"$PYTHON" -c 'import sys, pynvml, psutil; print(sys.version.split()[0], "nvidia-ml-py", getattr(pynvml, "__version__", "?"))'
pgrep -a nvidia-cuda-mps || echo "no MPS daemon running before the checks"

step "2. gpu_probe.py"
timeout 180 "$PYTHON" "$HERE/gpu_probe.py" -o "$OUT/probe.json"
echo "[gpu_probe exit $?]"

step "3. mig_calibrate.py --gpu 0"
timeout 240 "$PYTHON" "$HERE/mig_calibrate.py" --gpu 0 -o "$OUT/calibrate.json"
echo "[mig_calibrate exit $?]"

step "4. mps_gpu_check.sh"
PYTHON=$PYTHON timeout 300 bash "$HERE/mps_gpu_check.sh" "$OUT/mps"
echo "[mps_gpu_check exit $?]"

step "after"
pgrep -a nvidia-cuda-mps || echo "no MPS daemon left running"
ls -lR "$OUT"
