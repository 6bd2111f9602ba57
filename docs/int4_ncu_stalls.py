"""Launches the int4 GEMV (engine.core.gemv_int4.launch: the row kernel, then the GEMV) on the 27B shape's TP1
gate/up (norm prologue) and down (SiLU prologue) in the configurations given, three calls each, for Nsight
Compute to read its stall reasons (bash docs/h200_subn_run.sh i). Each argument: matrix:BN,BK,warps,split,stages,form
[:q] (q: the words held in quads). Run from the repository root: python3 docs/int4_ncu_stalls.py gate_up:64,128,4,4,2,1"""

import sys

import torch  # noqa: TID253 - a device script, not part of the package

from engine.bench.int4 import _packed
from engine.core import gemv, gemv_int4

SHAPES = {"gate_up": ((34816, 5120), gemv.PROLOGUE_NORM), "down": ((5120, 17408), gemv.PROLOGUE_SILU)}
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
for arg in sys.argv[1:]:
    name, blocks, *lay = arg.split(":")
    (n, k), pro = SHAPES[name]
    cfg = tuple(int(v) for v in blocks.split(","))
    w = _packed(n, k, 128, dev, g).tiled(32, quads=bool(lay and lay[0] == "q"))
    x = torch.randn(2 * k if pro == gemv.PROLOGUE_SILU else k, device=dev, generator=g).bfloat16()
    d, nw = torch.randn(k, device=dev, generator=g).bfloat16(), torch.ones(k, device=dev, dtype=torch.bfloat16)
    out, xo = torch.empty(n, device=dev, dtype=torch.bfloat16), torch.empty(k, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        if pro == gemv.PROLOGUE_NORM:
            gemv_int4.launch(pro, x, w, None, out, d, nw, 1e-6, xo, blocks=cfg)
        else:
            gemv_int4.launch(pro, x, w, None, out, blocks=cfg)
    torch.cuda.synchronize()
    print(arg, n, k, w.nbytes, "bytes")
