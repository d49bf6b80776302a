#!/usr/bin/env bash
# Real-GPU check of what migd assumes about NVIDIA MPS (docs/mps.md, "What needs a real GPU").
#
#   scripts/mps_gpu_check.sh [OUT_DIR]        (default OUT_DIR: tests/data/mps_gpu_check)
#
# Starts a private MPS control daemon (own pipe and log directories, CUDA_VISIBLE_DEVICES
# set to one GPU's UUID), runs CUDA clients against it with and without
# CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, records every command and reply, captures the OOMs,
# and quits the daemon. Results go to OUT_DIR/<UTC time>-<host>/: summary.txt (commands,
# replies, exit codes), clients.jsonl (one JSON object per client), control.log, server.log.
#
# It changes no GPU setting: no compute mode (MPS runs in the DEFAULT mode too), no MIG
# mode, no clocks, no persistence mode. It reads nvidia-smi only with --query options.
# Other MPS daemons (e.g. a system one on /tmp/nvidia-mps) are not touched: everything here
# talks to the private pipe directory only.
#
# Environment (all optional):
#   GPU_UUID     GPU or MIG device to use (default: the first GPU from nvidia-smi)
#   MPS_CONTROL  the control binary (default: nvidia-cuda-mps-control)
#   LIMIT_MIB    per-client limit given in the client's environment (default 1024)
#   DEFAULT_MIB  the daemon's default per-client limit (default 2048)
#   PYTHON       interpreter for the clients (default: python3); uses PyTorch if it can be
#                imported, else the CUDA driver API through ctypes (libcuda.so.1).
set -uo pipefail

OUT_ROOT=${1:-tests/data/mps_gpu_check}
MPS_CONTROL=${MPS_CONTROL:-nvidia-cuda-mps-control}
PYTHON=${PYTHON:-python3}
LIMIT_MIB=${LIMIT_MIB:-1024}
DEFAULT_MIB=${DEFAULT_MIB:-2048}
if [[ -z ${GPU_UUID:-} ]]; then
  GPU_UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -n 1)
fi
if [[ -z ${GPU_UUID:-} ]]; then
  echo "no GPU found (nvidia-smi --query-gpu=uuid gave nothing); set GPU_UUID" >&2
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

cleanup() {
  if [[ -s "$PIPE/nvidia-cuda-mps-control.pid" ]]; then
    note "cleanup: quit"
    ctl quit >/dev/null
  fi
  cp "$LOGD"/*.log "$RUN_DIR"/ 2>/dev/null
  ls -la "$PIPE" >"$RUN_DIR/pipe_dir_listing.txt" 2>&1
  rm -rf "$WORK"
  echo "results: $RUN_DIR"
}
trap cleanup EXIT

cat >"$WORK/client.py" <<'PY'
"""One MPS client: allocate TARGET MiB in CHUNK MiB steps, report how far it got as JSON."""
import ctypes, json, os, sys, time

label, target_mib = sys.argv[1], int(sys.argv[2])
chunk_mib = int(os.environ.get("CHUNK_MIB", "64"))
hold_s = float(os.environ.get("HOLD_S", "0"))
result = {
    "label": label, "pid": os.getpid(), "target_mib": target_mib,
    "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_")},
}
try:
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
    except torch.OutOfMemoryError as exc:  # torch >= 2.x; RuntimeError on older
        result["outcome"], result["error"] = "oom", str(exc).splitlines()[0]
        result["error_type"] = type(exc).__name__
    except RuntimeError as exc:
        result["outcome"], result["error"] = "error", str(exc).splitlines()[0]
        result["error_type"] = type(exc).__name__
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
                break
            done += chunk_mib
        else:
            result["outcome"] = "allocated"
        result["allocated_mib"] = done
    except RuntimeError as exc:
        result["outcome"], result["error"] = "error", str(exc.args[0])
if hold_s:
    time.sleep(hold_s)
print(json.dumps(result), flush=True)
PY

# client LABEL TARGET_MIB [VAR=VALUE...]: run one client with the job environment migd gives
client() {
  local label=$1 target=$2
  shift 2
  note "client $label: allocate $target MiB with $*"
  env CUDA_MPS_PIPE_DIRECTORY="$PIPE" CUDA_MPS_LOG_DIRECTORY="$LOGD" \
    CUDA_VISIBLE_DEVICES="$GPU_UUID" "$@" "$PYTHON" "$WORK/client.py" "$label" "$target" \
    2>>"$SUMMARY" | tee -a "$CLIENTS" >>"$SUMMARY"
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
for _ in $(seq 50); do [[ -s "$PIPE/nvidia-cuda-mps-control.pid" ]] && break; sleep 0.1; done
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
ctl "set_default_device_pinned_mem_limit $GPU_UUID ${DEFAULT_MIB}M" \
  "get_default_device_pinned_mem_limit $GPU_UUID" >/dev/null
ctl "set_default_device_pinned_mem_limit 0 lots" >/dev/null  # a rejected command: its message

note "4. client over its env limit (expect OOM near $LIMIT_MIB MiB)"
client over_env_limit $((LIMIT_MIB * 2)) CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M"

note "5. client without the env var (expect OOM near the daemon default, $DEFAULT_MIB MiB)"
client no_env $((DEFAULT_MIB + 512))

note "6. client whose env limit is above the daemon default (does the env raise it?)"
client env_above_default $((DEFAULT_MIB + 512)) \
  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=$((DEFAULT_MIB + 1024))M"

note "7. client with a compute share, and the server/client lists while it runs"
HOLD_S=5 client held 256 CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=${LIMIT_MIB}M" \
  CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 &
held=$!
sleep 3
servers=$(ctl get_server_list)
for server in $servers; do
  ctl "get_client_list $server" "get_device_pinned_mem_limit $server $GPU_UUID" \
    "get_active_thread_percentage $server" >/dev/null
done
wait "$held"

note "8. quit (exit status), then the front end again"
pid=$(cat "$PIPE/nvidia-cuda-mps-control.pid" 2>/dev/null)
ctl quit >/dev/null
for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
kill -0 "$pid" 2>/dev/null && echo "daemon $pid still alive after quit" >>"$SUMMARY"
ctl get_server_list >/dev/null
exit 0
