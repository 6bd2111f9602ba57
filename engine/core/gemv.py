"""A Triton GEMV for the decode step's one-row products (y [1, N] = x [1, K] @ W [N, K]^T + b).

At M = 1 cuBLAS reads the narrow matrices (QKV, o_proj, down: N or K of 4096) through split-K plus a
separate reduce kernel, at 2700-3350 GB/s on an H200 against 4089 GB/s for the wide gate/up product
(docs/engine-speed.md, profile of 2026-11-30). This kernel gives each program a few whole rows and
walks K in 16-byte vector loads, one kernel per product, no split and no reduce: every product is as
wide as its N rows, and the sum over K stays in float32 and in a fixed order (deterministic, the same
on every rank). Exposed as the torch op ``v100plan::gemv`` so torch.compile'd blocks keep it as one
opaque call and fuse around it.

Only where Triton targets the card (compute capability 8.0+, as engine.core.runner.kernel_choice);
never on CPU or the V100, which keep F.linear. The block sizes per (N, K) come from the measured table
BLOCKS (bench: ``python -m engine.bench.gemv``), with a default for shapes it does not list.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import torch.nn.functional as F

# (N, K) -> (BLOCK_N rows per program, BLOCK_K columns per iteration, num_warps): the fastest of CONFIGS
# per shape of the 8B models at TP1 and TP2, measured on an H200 on 2026-11-30
# (tests/fixtures/engine/h200-gemv-2026-11-30.json, judged by tests/test_engine_gemv_recording.py).
DEFAULT_BLOCKS = (2, 1024, 4)  # the most frequent winner there
BLOCKS: dict[tuple[int, int], tuple[int, int, int]] = {
    (6144, 4096): (8, 512, 4),
    (4096, 4096): (2, 1024, 4),
    (24576, 4096): (2, 1024, 4),
    (4096, 12288): (2, 1024, 4),
    (3072, 4096): (8, 1024, 8),
    (4096, 2048): (4, 512, 4),
    (12288, 4096): (2, 1024, 4),
    (4096, 6144): (4, 512, 4),
    (28672, 4096): (2, 1024, 4),
    (4096, 14336): (2, 1024, 4),
}
BLOCKS_ENV = "V100PLAN_ENGINE_GEMV_BLOCKS"  # a JSON file {"NxK": [BLOCK_N, BLOCK_K, num_warps]} (the bench's "best")
CONFIGS = [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 256, 4), (4, 1024, 8), (8, 1024, 8),
           (16, 512, 8), (2, 2048, 8), (1, 2048, 4)]


def _load_blocks() -> None:
    path = os.environ.get(BLOCKS_ENV)
    if path:
        with open(path) as fh:
            raw = json.load(fh)
        raw = raw.get("best", raw)
        BLOCKS.update({tuple(int(v) for v in key.split("x")): tuple(int(v) for v in val) for key, val in raw.items()})


_load_blocks()


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(w_ptr, x_ptr, b_ptr, y_ptr, N, K, stride_w, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols0 = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        wp = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols0[None, :]
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(wp + k0, mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + cols0)
            else:
                cmask = (k0 + cols0) < K
                w = tl.load(wp + k0, mask=rmask[:, None] & cmask[None, :], other=0.0,
                            eviction_policy="evict_first")
                x = tl.load(x_ptr + k0 + cols0, mask=cmask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    return gemv_kernel


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
           blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [N] = w [N, K] @ x [K] (+ b): the raw launch (x, w contiguous; out preallocated)."""
    n, k = w.shape
    bn, bk, warps = blocks or BLOCKS.get((n, k), DEFAULT_BLOCKS)
    _kernel()[(-(-n // bn),)](w, x, b if b is not None else w, out, n, k, w.stride(0), HAS_BIAS=b is not None,
                              BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, num_warps=warps)
    return out


@torch.library.custom_op("v100plan::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    return launch(x.reshape(-1).contiguous(), w, b, out)


@gemv_op.register_fake
def _(x, w, b):
    return torch.empty(w.shape[0], dtype=x.dtype, device=x.device)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for the decode step: the Triton GEMV when x is one row on a CUDA device, else F.linear."""
    if x.device.type != "cuda" or x.numel() != w.shape[1]:
        return F.linear(x, w, b)
    return gemv_op(x, w, b).view(*x.shape[:-1], w.shape[0])
