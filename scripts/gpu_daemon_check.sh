#!/usr/bin/env bash
# migd itself on a real GPU: the daemon on NVML with GPU 0 in MPS mode, and the job
# wrapper running two CUDA jobs through it.
#
#   scripts/gpu_daemon_check.sh OUT_DIR
#
# 1. starts migd (backend nvml, [[gpu]] 0 mode = "mps", state, runtime and socket under a
#    private /tmp directory, HTCondor not involved);
# 2. job hw.1 leases 4 GiB and allocates 2500 MiB with PyTorch: it must fit (the pinned
#    limit counts the CUDA context too); migctl status and usage are recorded meanwhile;
# 3. job hw.2 leases 2 GiB and allocates 3000 MiB: its first run must hit the MPS limit,
#    the wrapper must classify the CUDA OOM and rerun it on a bigger share, which fits;
# 4. job hw.3 runs while migd gets SIGTERM and starts again: the lease must be restored,
#    its MPS daemon adopted, and the job finish;
# 5. SIGTERM to migd; then no MPS daemon of ours may be left.
# It changes no GPU setting (MPS runs in the DEFAULT compute mode); every MPS daemon it
# starts has its own pipe directory under the private directory.
# MIGD_SIMULATE=1xV100-32GB runs the same steps on the simulated backend (no GPU).
# MIGD_MODE=mig runs them with GPU 0 in migd's MIG mode (the GPU must already be in MIG
# mode and empty; migd makes and destroys the jobs' instances); default mps.
# Results: OUT_DIR/daemon_check.log, migd.log, status-*.json, usage-hw1.json,
# explain-hw2.json, leases.json.
set -uo pipefail
OUT=${1:?usage: scripts/gpu_daemon_check.sh OUT_DIR}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
MODE=${MIGD_MODE:-mps}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/daemon_check.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$HERE/..${PYTHONPATH:+:$PYTHONPATH}"
smi=$(command -v nvidia-smi || true)
[[ -n $smi ]] && PATH="$PATH:$(dirname "$smi")"
ROOT=$(mktemp -d /tmp/migd-hw.XXXXXX)
SOCK=$ROOT/run/migd.sock
export MIGD_API_SOCKET=$SOCK  # the simulated CUDA job finds the simulated GPU through it
step() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }
ctl() { "$PYTHON" -m migd.cli.migctl --socket "$SOCK" "$@"; }
# start_migd: migd in the background (pid in MIGD), back once it answers
start_migd() {
  "$PYTHON" -m migd --config "$ROOT/migd.toml" "${sim[@]}" >>"$OUT/migd.log" 2>&1 &
  MIGD=$!
  for _ in $(seq 150); do ctl status >/dev/null 2>&1 && break; sleep 0.2; done
}
# start_job ID MIB HOLD_S: the job through the wrapper on a 4 GiB MPS share, in the
# background (pid in JOB), back once it holds its memory (PyTorch takes seconds to start)
start_job() {
  MARK=$ROOT/$1.allocated "$PYTHON" -m migd.wrapper.main --socket "$SOCK" --gpu-memory 4G \
    --mode "$MODE" --job-id "$1" -- "$PYTHON" "$ROOT/job.py" "$2" "$3" &
  JOB=$!
  for _ in $(seq 300); do [[ -e $ROOT/$1.allocated ]] && break; sleep 0.2; done
}

cat >"$ROOT/migd.toml" <<EOF
version = 1
[daemon]
state_dir = "$ROOT/state"
runtime_dir = "$ROOT/run"
log_format = "json"
log_level = "debug"
[api]
socket = "$SOCK"
[htcondor]
offline_gpus = false
[[gpu]]
match = "0"
mode = "$MODE"
EOF
# Simulated GPUs keep their MIG instances across the restart of step 4 only in a state
# file, as real GPUs keep theirs (without it the restarted migd found hw.3's instance gone).
[[ -n ${MIGD_SIMULATE:-} ]] && printf '[backend]\nsim_state_file = "%s"\n' "$ROOT/sim-state.json" >>"$ROOT/migd.toml"
# The job: allocate TARGET MiB in 64 MiB pieces with PyTorch, hold it, exit 0; a CUDA OOM
# goes to stderr as PyTorch prints it, exit 1. On the simulated backend: its CUDA job.
cat >"$ROOT/job.py" <<'EOF'
import os, sys, time
target, hold = int(sys.argv[1]), float(sys.argv[2])
print("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"),
      "limit", os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), flush=True)
try:
    import torch
except ImportError:
    # The simulated job, as a child: the mark once it holds its memory (its first "step"
    # line comes after it reached migd and allocated). A mark before it starts let step
    # 4 stop migd before a loaded host's job had reached it, and the job failed its init.
    import subprocess
    job = subprocess.Popen([sys.executable, "-m", "migd.backends.simulated.cuda_job",
                            "--start", f"{target}M", "--steps", str(int(hold * 10)),
                            "--step-s", "0.1"], stdout=subprocess.PIPE, text=True)
    for line in job.stdout:
        print(line, end="", flush=True)
        if line.startswith("step ") and os.environ.get("MARK"):
            open(os.environ["MARK"], "a").close()
    sys.exit(job.wait())
free, total = torch.cuda.mem_get_info()
print(f"mem_get_info free {free >> 20} MiB of {total >> 20} MiB", flush=True)
held = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(target // 64)]
print(f"allocated {len(held) * 64} MiB", flush=True)
if os.environ.get("MARK"):
    open(os.environ["MARK"], "w").close()
time.sleep(hold)
EOF

step "1. migd (backend ${MIGD_SIMULATE:+simulated }nvml, GPU 0 mode $MODE)"
sim=()
[[ -n ${MIGD_SIMULATE:-} ]] && sim=(--simulate "$MIGD_SIMULATE")
start_migd
ctl status
ctl status --json >"$OUT/status-start.json"

step "2. hw.1: a 4 GiB MPS share, 2500 MiB allocated"
start_job hw.1 2500 8
lease=$(ctl leases --json | "$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); print(next(x["lease_id"] for x in d["leases"] if x["job_id"]=="hw.1"))')
sleep 1.5  # one more round of migd's memory sampler
ctl status --json >"$OUT/status-running.json"
ctl status
"$PYTHON" -c 'import json,sys; from migd.client import MigdClient; print(json.dumps(MigdClient(sys.argv[1]).call("usage", lease_id=sys.argv[2]), indent=1))' "$SOCK" "$lease" | tee "$OUT/usage-hw1.json"
wait $JOB
echo "[hw.1 exit $?]"

step "3. hw.2: a 2 GiB share, 3000 MiB allocated: OOM, then a bigger share"
"$PYTHON" -m migd.wrapper.main --socket "$SOCK" --gpu-memory 2G --mode "$MODE" --job-id hw.2 \
  -- "$PYTHON" "$ROOT/job.py" 3000 1
echo "[hw.2 exit $?]"
ctl explain hw.2 --json >"$OUT/explain-hw2.json" 2>&1 || ctl explain hw.2
ctl status --json >"$OUT/status-end.json"

step "4. a migd restart while hw.3 runs: the lease and its MPS daemon are adopted"
start_job hw.3 1000 20
ctl status --json >"$OUT/status-before-restart.json"
kill -TERM "$MIGD"
wait "$MIGD"
echo "[migd exit $? with hw.3 running]"
pgrep -a nvidia-cuda-mps || echo "no MPS daemon running"
start_migd
ctl status
ctl status --json >"$OUT/status-after-restart.json"
ctl leases --json
wait $JOB
echo "[hw.3 exit $?]"
ctl leases --all --json >"$OUT/leases.json"

step "5. SIGTERM"
kill -TERM "$MIGD"
wait "$MIGD"
echo "[migd exit $?]"
pgrep -a nvidia-cuda-mps || echo "no MPS daemon left running"
ls -la "$OUT"
