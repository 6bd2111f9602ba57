"""Launches the int4 GEMV the decode step runs (engine.kernels.gemv_int4.launch: the row kernel, then the GEMV) on
two of the 27B shape's matrices at TP1, gate/up (norm prologue) and down (SiLU prologue), words held in tiles as
the engine holds them, three calls each, for Nsight Compute to read its counters (docs/h200_defaults_run.sh c).
Run from the repository root: python3 docs/int4_ncu.py."""

import torch  # noqa: TID253 - a device script, not part of the package

from engine import tuning
from engine.bench.int4 import _packed
from engine.kernels import decode, gemv_int4

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
for name, (n, k), pro in (("gate_up", (34816, 5120), decode.PROLOGUE_NORM), ("down", (5120, 17408), decode.PROLOGUE_SILU)):
    w = gemv_int4.held(_packed(n, k, 128, dev, g), dev)
    x = torch.randn(2 * k if pro == decode.PROLOGUE_SILU else k, device=dev, generator=g).bfloat16()
    d, nw = torch.randn(k, device=dev, generator=g).bfloat16(), torch.ones(k, device=dev, dtype=torch.bfloat16)
    out, xo = torch.empty(n, device=dev, dtype=torch.bfloat16), torch.empty(k, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        if pro == decode.PROLOGUE_NORM:
            gemv_int4.launch(pro, x, w, None, out, d, nw, 1e-6, xo)
        else:
            gemv_int4.launch(pro, x, w, None, out)
    torch.cuda.synchronize()
    print(name, n, k, w.nbytes, "bytes", tuning.active().int4.get((decode.PROLOGUE_NAMES[pro], n, k)))
