"""Two processes sharing device memory through CUDA IPC: what the engine's device mailbox needs.

This process allocates a buffer on card ``src`` and writes 0..N-1; a second process
(probes/ipc_child.py) opens it with cudaIpcOpenMemHandle on card ``dst``, checks the sum
and doubles every element; this process then checks the doubling landed. ``src == dst``
is the same-device check; ``src != dst`` needs working peer access.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

COUNT = 10240  # 40 KB of float32: the size of a decode allreduce message


def check(cp: Any, src: int, dst: int, timeout_s: float = 90) -> tuple[bool, str]:
    """(works, explanation)."""
    with cp.cuda.Device(src):
        buf = cp.arange(COUNT, dtype=cp.float32)  # [COUNT]
        cp.cuda.Device(src).synchronize()
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr))
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        try:
            r = subprocess.run(
                [sys.executable, "-m", "probes.ipc_child", "--device", str(dst), "--handle", handle.hex(),
                 "--count", str(COUNT)],
                capture_output=True, text=True, timeout=timeout_s, env=env,
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            )
        except subprocess.TimeoutExpired:
            return False, f"the second process did not finish within {timeout_s:.0f} s"
        lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
        if not lines:
            return False, f"the second process printed no result (exit {r.returncode}): {r.stderr.strip()[-300:]}"
        got = json.loads(lines[-1])
        if not got.get("ok"):
            return False, f"the second process could not use the buffer: {got.get('error')}"
        want = COUNT * (COUNT - 1) / 2
        if got["sum_seen"] != want:
            return False, f"the second process saw sum {got['sum_seen']}, expected {want}"
        doubled = bool((buf == cp.arange(COUNT, dtype=cp.float32) * 2).all())
        if not doubled:
            return False, "the second process's writes did not reach this process's buffer"
    where = "on the same card" if src == dst else f"from card {src} to card {dst}"
    return True, f"a second process read and wrote a 40 KB buffer {where} through CUDA IPC"
