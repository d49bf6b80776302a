#!/usr/bin/env bash
# Real-GPU check of what migd assumes about NVIDIA MPS (docs/mps.md, "What needs a real GPU").
#
#   scripts/mps_gpu_check.sh [--dry-run] [OUT_DIR]   (default OUT_DIR: tests/data/mps_gpu_check)
#
# --dry-run checks the environment (binaries, the GPU, Python with migd) and prints the
# plan without starting anything; tests/mps/test_gpu_check_script.py runs it that way.
#
# Starts a private MPS control daemon (own pipe and log directories, CUDA_VISIBLE_DEVICES
# set to one GPU's UUID), runs CUDA clients against it with and without
# CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, records every command and reply, captures the OOMs,
# and quits the daemon. Then it runs migd's own MpsManager against the same binary and
# classifies each client's exit with the wrapper's OOM classifier
# (scripts/mps_migd_check.py). Results go to OUT_DIR/<UTC time>-<host>/: summary.txt
# (commands, replies, exit codes), clients.jsonl (one JSON object per client),
# control.log, server.log, migd_check.json and result.json (all of it in one file, for
# tests/data/).
#
# It changes no GPU setting: no compute mode (MPS runs in the DEFAULT mode too), no MIG
# mode, no clocks, no persistence mode. It reads nvidia-smi only with --query options.
# Other MPS daemons (e.g. a system one on /tmp/nvidia-mps) are not touched: everything here
# talks to the private pipe directory only.
#
# Environment (all optional):
#   GPU_UUID     GPU or MIG device to use (default: the first GPU from nvidia-smi). A GPU
#                with MIG enabled is refused: give one of its MIG devices (MIG-...).
#   MPS_CONTROL  the control binary (default: nvidia-cuda-mps-control)
#   LIMIT_MIB    per-client limit given in the client's environment (default 1024)
#   DEFAULT_MIB  the daemon's default per-client limit (default 2048)
#   PYTHON       interpreter for the clients (default: python3); uses PyTorch if it can be
#                imported, else the CUDA driver API through ctypes (libcuda.so.1).
#   SECOND_USER  (as root) a second Linux user whose client arrives while the first user's
#                server has a client (step 7c); skipped when unset.
#   SECOND_PYTHON interpreter for that user's client (default /usr/bin/python3: the first
#                user's may sit in a private directory).
#   CAP_CLIENTS  how many light clients (driver API, no PyTorch) step 10 starts at once to
#                find the client cap (default 50: NVIDIA documents 48 since Volta)
# A client that is to be held writes a mark file once it has its memory; the script waits
# for that mark (never a fixed sleep: a client took from 45 ms to seconds to connect).
# Each step appends to the summary on its own, on purpose (SC2129).
# shellcheck disable=SC2129
set -uo pipefail

DRY_RUN=0
if [[ ${1:-} == --dry-run ]]; then
  DRY_RUN=1
  shift
fi
OUT_ROOT=${1:-tests/data/mps_gpu_check}
MPS_CONTROL=${MPS_CONTROL:-nvidia-cuda-mps-control}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${LIMIT_MIB:-1024}
DEFAULT_MIB=${DEFAULT_MIB:-2048}
CAP_CLIENTS=${CAP_CLIENTS:-50}
# Above a CUDA context (about 514 MiB with PyTorch on CUDA 13, H200 recording) and below
# the daemon's limit: a client under it starts and then runs out at this limit.
MB_LIMIT=$((LIMIT_MIB + 256))
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

problems=()
command -v "$MPS_CONTROL" >/dev/null 2>&1 || problems+=("no MPS control binary: $MPS_CONTROL")
command -v nvidia-smi >/dev/null 2>&1 || problems+=("no nvidia-smi")
if ! "$PYTHON" -c 'import sys; sys.path.insert(0, sys.argv[1]); import migd.backends.mps' \
  "$HERE/.." >/dev/null 2>&1; then
  problems+=("$PYTHON cannot import migd from $HERE/..")
fi
if [[ -z ${GPU_UUID:-} ]]; then
  GPU_UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -n 1)
fi
if [[ -z ${GPU_UUID:-} ]]; then
  problems+=("no GPU found (nvidia-smi --query-gpu=uuid gave nothing); set GPU_UUID")
elif [[ $GPU_UUID == GPU-* ]]; then
  # An MPS daemon on the parent of a MIG GPU serves no MIG device: use a MIG device.
  mig=$(nvidia-smi -i "$GPU_UUID" --query-gpu=mig.mode.current --format=csv,noheader 2>/dev/null)
  if [[ ${mig// /} == Enabled ]]; then
    problems+=("GPU $GPU_UUID has MIG enabled: set GPU_UUID to one of its MIG devices (nvidia-smi -L)")
  fi
fi

plan() {
  cat <<EOF
plan (GPU_UUID=${GPU_UUID:-?} MPS_CONTROL=$MPS_CONTROL LIMIT_MIB=$LIMIT_MIB DEFAULT_MIB=$DEFAULT_MIB):
 1. the front end without a daemon
 2. start a private daemon (pipe and log directories under /tmp); a second -d on it
 3. server list, thread percentage, pinned limits by UUID and by index, a malformed command
 4. a client over its env limit (0=${LIMIT_MIB}M)
 5. a client without the variable (the daemon's default, ${DEFAULT_MIB}M)
 6. a client whose variable is above the default; one with the MB suffix (0=${MB_LIMIT}MB,
    above a CUDA context so that it shows the allocation limit)
 7. a held client with a compute share: its server's clients, limit and percentage, and
    NVML's process listing meanwhile (scripts/gpu_probe.py -> probe_during_mps.json)
 7b. two clients of one job at once, each under the job's limit (is the limit per process?)
 7c. a second user's client while the first user's client runs (SECOND_USER=${SECOND_USER:-unset})
 7d. a client that faults (illegal address in a kernel), then the server and a new client
 8. quit while a connected client still holds memory (does quit wait?), kill by pid if it
    will not go, the front end again
 10. the client cap: $CAP_CLIENTS light clients at once on a fresh daemon (how many connect?)
 11. -M (multi-user) daemon with a non-root client (SECOND_USER=${SECOND_USER:-unset})
 9. migd's MpsManager on the device: a share of $LIMIT_MIB MiB, clients classified by
    migd.core.oom (scripts/mps_migd_check.py), the daemon stopped
results: $OUT_ROOT/<UTC>-<host>/ summary.txt clients.jsonl migd_check.json result.json *.log
EOF
}

if ((DRY_RUN)); then
  plan
  if ((${#problems[@]})); then
    printf 'would not run: %s\n' "${problems[@]}"
  else
    echo "ready to run"
  fi
  exit 0
fi
if ((${#problems[@]})); then
  printf 'mps_gpu_check: %s\n' "${problems[@]}" >&2
  exit 2
fi

stamp=$(date -u +%Y%m%dT%H%M%SZ)
RUN_DIR="$OUT_ROOT/$stamp-$(hostname -s 2>/dev/null || echo host)"
mkdir -p "$RUN_DIR"
RUN_DIR=$(cd "$RUN_DIR" && pwd)
SUMMARY="$RUN_DIR/summary.txt"
CLIENTS="$RUN_DIR/clients.jsonl"
# Short path on purpose: the control socket path must stay under 108 bytes (AF_UNIX).
WORK=$(mktemp -d /tmp/migd-mps.XXXXXX)
PIPE="$WORK/pipe"
LOGD="$WORK/log"
mkdir -p "$PIPE" "$LOGD"
: >"$CLIENTS"
DAEMON_PID="" # from the pid file once the daemon runs (the file goes away with quit)

note() { printf '\n## %s\n' "$*" >>"$SUMMARY"; }

# ctl CMD... : send commands through the front end, as migd does; log output and status.
ctl() {
  local out rc
  out=$(printf '%s\n' "$@" | CUDA_MPS_PIPE_DIRECTORY="$PIPE" timeout 60 "$MPS_CONTROL" 2>&1)
  rc=$?
  {
    printf '$ printf %q | %s\n' "$(printf '%s\\n' "$@")" "$MPS_CONTROL"
    printf '%s\n' "$out"
    printf '[exit %s]\n' "$rc"
  } >>"$SUMMARY"
  printf '%s' "$out"
  return "$rc"
}

# stop_daemon: quit, and if the daemon is still there kill it by its pid, so that no
# orphan daemon is left on the GPU behind a removed pipe directory.
stop_daemon() {
  local pid=${DAEMON_PID:-}
  if [[ -z $pid && -s "$PIPE/nvidia-cuda-mps-control.pid" ]]; then
    pid=$(<"$PIPE/nvidia-cuda-mps-control.pid")
  fi
  [[ -z $pid ]] && return 0
  if kill -0 "$pid" 2>/dev/null; then
    note "stop: quit daemon $pid"
    ctl quit >/dev/null
    for _ in $(seq 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  fi
  if kill -0 "$pid" 2>/dev/null; then
    echo "daemon $pid still alive after quit: SIGTERM, then SIGKILL" >>"$SUMMARY"
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null
    sleep 0.5
  fi
  if kill -0 "$pid" 2>/dev/null; then
    echo "daemon $pid survived SIGKILL" >>"$SUMMARY"
    return 1
  fi
  DAEMON_PID=""
}

# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  if stop_daemon; then
    cp "$LOGD"/*.log "$RUN_DIR"/ 2>/dev/null
    ls -la "$PIPE" >"$RUN_DIR/pipe_dir_listing.txt" 2>&1
    rm -rf "$WORK"
  else
    echo "keeping $WORK: MPS daemon $DAEMON_PID still runs there" >&2
  fi
  echo "results: $RUN_DIR"
}
trap cleanup EXIT

cat >"$WORK/client.py" <<'PY'
"""One MPS client: allocate TARGET MiB in CHUNK MiB steps, report how far it got as JSON.

Errors also go to stderr, as a job's would: the wrapper classifies the stderr tail.
"""
import ctypes, json, os, sys, time

label, target_mib = sys.argv[1], int(sys.argv[2])
chunk_mib = int(os.environ.get("CHUNK_MIB", "64"))
hold_s = float(os.environ.get("HOLD_S", "0"))
mark = os.environ.get("MARK", "")
result = {
    "label": label, "pid": os.getpid(), "target_mib": target_mib,
    "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_")},
}
try:
    if os.environ.get("FORCE_DRIVER_API"):
        raise ImportError("driver API asked for")
    import torch
    result["api"] = f"torch {torch.__version__}"
    free, total = torch.cuda.mem_get_info()
    result["mem_get_info_mib"] = [free >> 20, total >> 20]
    result["total_memory_mib"] = torch.cuda.get_device_properties(0).total_memory >> 20
    held, done = [], 0
    try:
        while done < target_mib:
            held.append(torch.empty(chunk_mib << 20, dtype=torch.uint8, device="cuda"))
            done += chunk_mib
        result["outcome"] = "allocated"
    except RuntimeError as exc:  # torch.OutOfMemoryError is a RuntimeError, and only newer
        first = (str(exc).splitlines() or [""])[0]
        result["outcome"] = "oom" if "out of memory" in first.lower() else "error"
        result["error"], result["error_type"] = first, type(exc).__name__
        print(f"{type(exc).__name__}: {first}", file=sys.stderr, flush=True)
    result["allocated_mib"] = done
except ImportError:
    result["api"] = "libcuda (ctypes)"
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        result["outcome"], result["error"] = "error", f"no CUDA driver library: {exc}"
        print(json.dumps(result), flush=True)
        sys.exit(0)
    def check(name, code):
        if code != 0:
            msg = ctypes.c_char_p()
            cuda.cuGetErrorString(code, ctypes.byref(msg))
            raise RuntimeError(f"{name}: CUDA error {code} ({(msg.value or b'').decode()})", code)
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    try:
        check("cuInit", cuda.cuInit(0))
        check("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), 0))
        check("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        check("cuMemGetInfo", cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)))
        result["mem_get_info_mib"] = [free.value >> 20, total.value >> 20]
        done, ptr = 0, ctypes.c_uint64()
        while done < target_mib:
            code = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(chunk_mib << 20))
            if code != 0:
                msg = ctypes.c_char_p()
                cuda.cuGetErrorString(code, ctypes.byref(msg))
                result["outcome"] = "oom" if code == 2 else "error"  # 2: CUDA_ERROR_OUT_OF_MEMORY
                result["error"] = f"cuMemAlloc: CUDA error {code} ({(msg.value or b'').decode()})"
                print(result["error"], file=sys.stderr, flush=True)
                break
            done += chunk_mib
        else:
            result["outcome"] = "allocated"
        result["allocated_mib"] = done
    except RuntimeError as exc:
        result["outcome"], result["error"] = "error", str(exc.args[0])
        print(result["error"], file=sys.stderr, flush=True)
if mark:  # connected (or failed): whoever waits for this client may go on
    open(mark, "w").close()
if hold_s:
    time.sleep(hold_s)
print(json.dumps(result), flush=True)
PY

# wait_mark FILE PID: until the client PID wrote FILE (it is connected) or is gone
wait_mark() {
  local i
  for i in $(seq 1200); do
    [[ -e $1 ]] && return 0
    kill -0 "$2" 2>/dev/null || break
    sleep 0.1
  done
  echo "[waited $((i / 10)) s for $1 of client $2: $([[ -e $1 ]] && echo there || echo missing)]" \
    >>"$SUMMARY"
  [[ -e $1 ]]
}

# record CMD...: run a client program; its one JSON line goes to clients.jsonl and the
# summary in a single write each, so clients running at once never interleave their lines.
record() {
  local out
  out=$("$@" 2>>"$SUMMARY")
  printf '%s\n' "$out" >>"$CLIENTS"
  printf '%s\n' "$out" >>"$SUMMARY"
}

# client LABEL TARGET_MIB [VAR=VALUE...]: run one client with the job environment migd gives
client() {
  local label=$1 target=$2
  shift 2
  note "client $label: allocate $target MiB with $*"
  record env CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGD" \
    CUDA_VISIBLE_DEVICES="$GPU_UUID" "$@" "$PYTHON" "$WORK/client.py" "$label" "$target"
}

{
  echo "# migd MPS check, $stamp"
  echo "GPU_UUID=$GPU_UUID LIMIT_MIB=$LIMIT_MIB DEFAULT_MIB=$DEFAULT_MIB MPS_CONTROL=$MPS_CONTROL"
  echo "pipe dir: $PIPE  log dir: $LOGD"
} >"$SUMMARY"
note "GPUs (read-only queries)"
nvidia-smi -L >>"$SUMMARY" 2>&1
nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.total,compute_mode,mig.mode.current \
  --format=csv >>"$SUMMARY" 2>&1
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
  >>"$SUMMARY" 2>&1

note "1. front end without a daemon (expect 'Cannot find MPS control daemon process', exit 1)"
ctl get_server_list >/dev/null

note "2. start the daemon; pid file name; a second -d on the same pipe dir"
CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGD" CUDA_VISIBLE_DEVICES="$GPU_UUID" \
  timeout 60 "$MPS_CONTROL" -d >>"$SUMMARY" 2>&1
echo "[exit $?]" >>"$SUMMARY"
for _ in $(seq 50); do
  [[ -s "$PIPE/nvidia-cuda-mps-control.pid" ]] && break
  sleep 0.1
done
DAEMON_PID=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null)
ls -la "$PIPE" >>"$SUMMARY" 2>&1
CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGD" CUDA_VISIBLE_DEVICES="$GPU_UUID" \
  timeout 60 "$MPS_CONTROL" -d >>"$SUMMARY" 2>&1
echo "[exit $? of the second -d]" >>"$SUMMARY"

note "3. replies: server list, thread percentage, pinned limits by UUID and by index"
ctl get_server_list >/dev/null
ctl "set_default_active_thread_percentage 100" get_default_active_thread_percentage >/dev/null
ctl "set_default_device_pinned_mem_limit $GPU_UUID 1536M" \
  "get_default_device_pinned_mem_limit $GPU_UUID" "get_default_device_pinned_mem_limit 0" \
  >/dev/null
# migd sets limits by index 0 (limits by UUID were seen not to apply: k8s-device-plugin#572)
ctl "set_default_device_pinned_mem_limit 0 ${DEFAULT_MIB}M" \
  "get_default_device_pinned_mem_limit 0" "get_default_device_pinned_mem_limit $GPU_UUID" \
  >/dev/null
ctl "set_default_device_pinned_mem_limit 0 lots" >/dev/null # a rejected command: its message

note "4. client over its env limit (expect OOM near $LIMIT_MIB MiB)"
client over_env_limit $((LIMIT_MIB * 2)) CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M"

note "5. client without the env var (expect OOM near the daemon default, $DEFAULT_MIB MiB)"
client no_env $((DEFAULT_MIB + 512))

note "6. client whose env limit is above the daemon default (NVIDIA: it does not raise it)"
client env_above_default $((DEFAULT_MIB + 512)) \
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=$((DEFAULT_MIB + 1024))M"

note "6b. client with the suffix of NVIDIA's example, 0=${MB_LIMIT}MB (expect OOM there, context included)"
client env_MB_suffix $((MB_LIMIT * 2)) CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${MB_LIMIT}MB"

note "7. client with a compute share, and the server/client lists while it runs"
HOLD_S=5 MARK=$WORK/held.mark client held 256 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" \
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 &
held=$!
wait_mark "$WORK/held.mark" "$held"
servers=$(ctl get_server_list)
for server in $servers; do
  ctl "get_client_list $server" "get_device_pinned_mem_limit $server 0" \
    "get_active_thread_percentage $server" >/dev/null
done
# NVML's view meanwhile (read-only): is the server a compute process, the client an MPS one?
"$PYTHON" "$HERE/gpu_probe.py" -o "$RUN_DIR/probe_during_mps.json" >>"$SUMMARY" 2>&1
echo "[gpu_probe exit $?]" >>"$SUMMARY"
wait "$held"

note "7b. two clients of one job at once, each allocating 3/4 of the job's ${LIMIT_MIB} MiB"
# Both succeed if the limit is per client process (NVIDIA/k8s-device-plugin#594, #720).
HOLD_S=3 client same_job_a $((LIMIT_MIB * 3 / 4)) CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" &
first=$!
HOLD_S=3 client same_job_b $((LIMIT_MIB * 3 / 4)) CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M"
wait "$first"

note "7c. a second user's client while the first user's client runs"
if [[ -n ${SECOND_USER:-} && $(id -u) == 0 ]]; then
  chmod 755 "$WORK" && chmod 644 "$WORK/client.py"
  HOLD_S=10 MARK=$WORK/first_user.mark client first_user 256 &
  holder=$!
  wait_mark "$WORK/first_user.mark" "$holder"
  note "client second_user ($SECOND_USER): expect it to wait for the first user's server"
  start=$(date +%s)
  record timeout 60 runuser -u "$SECOND_USER" -- env CUDA_MPS_PIPE_DIRECTORY="$PIPE" \
    CUDA_VISIBLE_DEVICES="$GPU_UUID" "${SECOND_PYTHON:-/usr/bin/python3}" "$WORK/client.py" \
    second_user 256
  echo "[second user's client took $(($(date +%s) - start)) s]" >>"$SUMMARY"
  wait "$holder"
  ctl get_server_list >/dev/null
else
  echo "skipped: set SECOND_USER and run as root" >>"$SUMMARY"
fi

note "7d. a client that faults (illegal address), then the server list and a new client"
cat >"$WORK/fault.py" <<'PY'
"""An MPS client whose kernel writes to address 0: a fatal fault (CUDA_ERROR_ILLEGAL_ADDRESS)."""
import ctypes, json, os, sys
PTX = b""".version 7.0
.target sm_70
.address_size 64
.visible .entry fault() { .reg .b64 %rd<2>; mov.u64 %rd1, 0; st.global.u32 [%rd1], 1; ret; }
"""
result = {"label": "fault", "pid": os.getpid()}
try:
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx, mod, fn = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    steps = [("cuInit", lambda: cuda.cuInit(0)),
             ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
             ("cuCtxCreate", lambda: cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)),
             ("cuModuleLoadData", lambda: cuda.cuModuleLoadData(ctypes.byref(mod), PTX)),
             ("cuModuleGetFunction", lambda: cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"fault")),
             ("cuLaunchKernel", lambda: cuda.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)),
             ("cuCtxSynchronize", lambda: cuda.cuCtxSynchronize())]
    for name, step in steps:
        code = step()
        result[name] = code
        if code != 0:
            msg = ctypes.c_char_p()
            cuda.cuGetErrorString(code, ctypes.byref(msg))
            result["error"] = f"{name}: CUDA error {code} ({(msg.value or b'').decode()})"
            print(result["error"], file=sys.stderr, flush=True)
            break
except OSError as exc:
    result["error"] = f"no CUDA driver library: {exc}"
print(json.dumps(result), flush=True)
PY
HOLD_S=8 MARK=$WORK/bystander.mark client bystander 256 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" &
bystander=$!
wait_mark "$WORK/bystander.mark" "$bystander"
record env CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGD" \
  CUDA_VISIBLE_DEVICES="$GPU_UUID" timeout 60 "$PYTHON" "$WORK/fault.py"
wait "$bystander"
ctl get_server_list >/dev/null
client after_fault 256 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M"

note "8. quit while a connected client holds memory (does quit wait for it?), then the front end again"
HOLD_S=10 MARK=$WORK/live.mark client live_at_quit 256 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" &
live=$!
wait_mark "$WORK/live.mark" "$live" && echo "[client $live is connected and holds its memory]" >>"$SUMMARY"
start=$(date +%s)
note "stop: quit daemon ${DAEMON_PID:-?} while client $live runs"
ctl quit >/dev/null
still=no
kill -0 "$live" 2>/dev/null && still=yes
echo "[quit returned after $(($(date +%s) - start)) s; client still running: $still]" >>"$SUMMARY"
wait "$live"
stop_daemon
ctl get_server_list >/dev/null

note "9. migd's MpsManager against $MPS_CONTROL (scripts/mps_migd_check.py)"
"$PYTHON" "$HERE/mps_migd_check.py" --binary "$MPS_CONTROL" --device "$GPU_UUID" \
  --limit-mib "$LIMIT_MIB" --out "$RUN_DIR/migd_check.json" -- "$PYTHON" "$WORK/client.py" \
  >>"$SUMMARY" 2>&1
echo "[exit $?]" >>"$SUMMARY"

# start_private_daemon [-M]: a fresh daemon on the private pipe directory (DAEMON_PID)
start_private_daemon() {
  CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGD" CUDA_VISIBLE_DEVICES="$GPU_UUID" \
    timeout 60 "$MPS_CONTROL" -d "$@" >>"$SUMMARY" 2>&1
  echo "[exit $? of -d $*]" >>"$SUMMARY"
  for _ in $(seq 100); do
    [[ -s "$PIPE/nvidia-cuda-mps-control.pid" ]] && break
    sleep 0.1
  done
  DAEMON_PID=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null)
}

note "10. the client cap: $CAP_CLIENTS light clients (driver API) at once on a fresh daemon"
start_private_daemon
caps=()
for i in $(seq "$CAP_CLIENTS"); do
  FORCE_DRIVER_API=1 HOLD_S=20 MARK=$WORK/cap$i.mark CHUNK_MIB=16 \
    client "cap_$i" 16 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" &
  caps+=($!)
done
for i in $(seq "$CAP_CLIENTS"); do
  wait_mark "$WORK/cap$i.mark" "${caps[$((i - 1))]}"
done
servers=$(ctl get_server_list)
for server in $servers; do
  connected=$(ctl "get_client_list $server" | grep -c '^[0-9]')
  echo "[client cap: $connected of $CAP_CLIENTS clients connected to server $server]" >>"$SUMMARY"
done
wait "${caps[@]}"
stop_daemon

note "11. a -M (multi-user) daemon and a non-root client"
if [[ -n ${SECOND_USER:-} && $(id -u) == 0 ]]; then
  start_private_daemon -M
  chmod 755 "$WORK" "$PIPE" && chmod 644 "$WORK/client.py"
  record timeout 60 runuser -u "$SECOND_USER" -- env CUDA_MPS_PIPE_DIRECTORY="$PIPE" \
    CUDA_VISIBLE_DEVICES="$GPU_UUID" CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" \
    "${SECOND_PYTHON:-/usr/bin/python3}" "$WORK/client.py" multi_user_non_root 256
  ctl get_server_list >/dev/null
  stop_daemon
else
  echo "skipped: set SECOND_USER and run as root" >>"$SUMMARY"
fi

"$PYTHON" - "$RUN_DIR" "$GPU_UUID" >>"$SUMMARY" 2>&1 <<'PY'
"""Everything in one file for tests/data/: the raw clients, migd's check, the host."""
import json, pathlib, socket, sys
run, gpu = pathlib.Path(sys.argv[1]), sys.argv[2]
lines = (run / "clients.jsonl").read_text().splitlines()
migd = run / "migd_check.json"
result = {
    "kind": "mps-gpu-check",
    "host": socket.gethostname(),
    "device": gpu,
    "clients": [json.loads(line) for line in lines if line.strip()],
    "migd": json.loads(migd.read_text()) if migd.exists() else None,
}
(run / "result.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
print("result.json written")
PY
exit 0
