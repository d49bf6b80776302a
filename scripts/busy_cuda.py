#!/usr/bin/env python3
"""A CUDA process that holds memory on its device until it is terminated.

``mig_calibrate.py --busy-command`` runs it with ``CUDA_VISIBLE_DEVICES=<MIG UUID>`` to
record what the driver answers when a busy compute instance is destroyed. Driver API
through ctypes (libcuda.so.1): no PyTorch needed. It prints one JSON line once it holds
its memory, then sleeps; SIGTERM ends it (and CUDA frees everything with the process).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time


def main() -> int:
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        print(json.dumps({"error": f"no CUDA driver library: {exc}"}), flush=True)
        return 2
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for name, code in (
        ("cuInit", cuda.cuInit(0)),
        ("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), 0)),
        ("cuCtxCreate", cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)),
        ("cuMemAlloc", cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))),
    ):
        if code != 0:
            print(json.dumps({"error": f"{name}: CUDA error {code}"}), flush=True)
            return 1
    print(json.dumps({"pid": os.getpid(), "holding_mib": mib}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    raise SystemExit(main())
