"""The second process of the CUDA IPC check: open another process's device buffer, check it, write it.

``python -m probes.ipc_child --device D --handle HEX --count N`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, required=True)
    ap.add_argument("--handle", required=True)
    ap.add_argument("--count", type=int, required=True)
    a = ap.parse_args()
    try:
        import cupy as cp

        with cp.cuda.Device(a.device):
            ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(a.handle))
            try:
                mem = cp.cuda.UnownedMemory(ptr, a.count * 4, None, a.device)
                arr = cp.ndarray((a.count,), cp.float32, cp.cuda.MemoryPointer(mem, 0))  # [count]
                seen = float(arr.astype(cp.float64).sum())
                arr *= 2  # the parent checks that this write landed in its buffer
                cp.cuda.Device(a.device).synchronize()
            finally:
                cp.cuda.runtime.ipcCloseMemHandle(ptr)
        print(json.dumps({"ok": True, "sum_seen": seen}))
        return 0
    except Exception as e:  # noqa: BLE001 - reported to the parent as data
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 1


if __name__ == "__main__":
    sys.exit(main())
