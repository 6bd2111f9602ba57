"""The decode step's launches (kernel choice ``fused``): five kernels per layer, the residual add + RMSNorm and
SiLU(gate) * up folded into the GEMV that follows them, and one kernel for the mixer's work between its two products.
Per layer, as the layer kinds run them (engine.model.attention's FullAttention, engine.model.gdn's GatedDeltaNet,
engine.model.base's DenseMLP):

  1. GEMV with a norm prologue (``linear_norm``): h = RMSNorm(x + delta), the mixer's input projection (qkv = h @
     Wqkv^T (+ b); a Gated DeltaNet's four projections in one product -> [conv channels q | k | v, z, b, a]);
     program 0 also writes x + delta, the new residual.
  2. the mixer's kernel:
     ``decode_attention`` (full attention): from the qkv row, per kv head: q/k RMSNorm (Qwen3), RoPE at ``pos``,
     K/V written into the cache at ``pos``, and the attention of the g query heads of that kv head over cache
     positions [0, window) with positions past ``pos`` masked; the window is split over programs (flash-decoding:
     partial max / sum / accumulator in float32), and the last program of a kv head to finish combines the
     partials in a fixed order (one kernel; ``combine="kernel"`` runs the combine as a second kernel).
     ``gdn_decode`` (Gated DeltaNet): one program per value head does the rest of the token's work: the causal conv
     of its channels over the ring (engine.kernels.gdn's layout: slot p % kernel holds position p's input; the
     program writes this position's slot and reads the kernel - 1 before it, never a slot another program writes),
     SiLU, L2 norms of q and k, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the delta rule on its
     float32 state [dk, dv] (read once, written once), the output and the gated RMSNorm -> y [value dim].
  3. o_proj / out_proj GEMV (``linear_send``, which can also send its rows to the TP2 peer).
  4. GEMV with a norm prologue for gate/up (as 1).
  5. GEMV with a SiLU(gate) * up prologue for down (``linear_silu``).

The Triton code is engine.kernels.gemv_jit's (the GEMV), attention_jit's (the attention, its combine) and
gdn_decode_jit's (the Gated DeltaNet step), each imported when it first launches (a CPU-only path imports no Triton).
The earlier blocks (torch.compile'd, ``gemv``) ran ~15 kernels per layer; the ~1 ms a step those small kernels cost
does not shrink when tensor parallelism halves the matrices (docs/engine-speed.md).

The GEMV: at M = 1 cuBLAS reads the narrow matrices (QKV, o_proj, down: N or K of 4096) through split-K plus a
separate reduce kernel, at 2700-3350 GB/s on an H200 against 4089 GB/s for the wide gate/up product
(docs/engine-speed.md, profile of 2026-11-30). This kernel gives each program a few whole rows and walks K in 16-byte
vector loads, one kernel per product, no split and no reduce: every product is as wide as its N rows, and the sum
over K stays in float32 and in a fixed order (deterministic, the same on every rank). The plain GEMV is the
prologue kernel with no prologue (PROLOGUE_PLAIN). Only where engine.core.decode_mode.kernel_choice picks Triton
kernels (compute capability 8.0+, and the V100 in fp16 with an sm_70 ptxas: engine.core.sm70); never on CPU, which
keeps F.linear. The block sizes per (N, K) come from the card family's tuning table (engine.tuning: ``gemv``,
``prologue``, ``fp16_silu``; bench: ``python -m engine.bench.gemv --write-table``), with a default for shapes it
does not list; the attention's from its ``attention`` (launch_config).

Rounding follows Hugging Face's (engine.model.base.rms_norm, rope; the eager Qwen3.5 for the Gated DeltaNet): norm
statistics in float32, the normalised row rounded to the model's dtype before the weight multiply and that product
rounded; the RoPE products and their sum rounded; K and V stored in the dtype. The attention itself keeps the
scores, the softmax and the value sums in float32 (more exact than the two bf16 products the plain blocks run). The
Gated DeltaNet step rounds the conv to the dtype and SiLU of it, beta in the dtype, g and the rule in float32, the
rule's output rounded, the gated norm as Qwen3_5RMSNormGated rounds it. Every reduction has a fixed order: the same
answer on every rank and every replay.

pos is a device tensor: no shape and no Python value depends on it, so one CUDA graph per window serves every
position below the window. Positions past pos are neither read nor computed (a program whose part of the window
starts past pos only writes an empty partial). The new K/V of position pos are used from registers, never read back
from the cache (no read-after-write between programs).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine import tuning
from engine.kernels.exchange import as_sent, epw, ticket_args
from engine.kernels.interpreter import interpreting
from engine.kernels.prologue import PROLOGUE_NAMES, PROLOGUE_NORM, PROLOGUE_PLAIN, PROLOGUE_SILU
from engine.kernels.shapes import attention_supported, gdn_supported, rotary_supported  # noqa: F401 (the blocks ask here)

# ---- where the kernels run ------------------------------------------------------------------------------------
CPU_KERNELS = False  # the tests set it (with TRITON_INTERPRET=1): the fused blocks run their kernels on CPU


def runs_here(device: torch.device) -> bool:
    """The kernels run on CUDA devices (and on CPU tensors in the tests, under Triton's interpreter);
    elsewhere the fused blocks are the plain blocks (the CPU dry run of the variants bench)."""
    return device.type == "cuda" or (CPU_KERNELS and interpreting())


# ---- the one-row GEMV ------------------------------------------------------------------------------------------
# The GEMV with its input made in the prologue: each program computes the input row itself from rows in L2 instead of
# a separate kernel writing it (engine.kernels.prologue). Block sizes per (N, K): the tuning table's ``prologue``
# (bench: python -m engine.bench.gemv --fused), else ``gemv``.


def _prologue_default(name: str, n: int, table) -> tuple[int, int, int]:
    """Blocks for a shape the table's ``prologue`` does not list (e.g. Llama-3.1-8B's gate/up and down): the recorded
    winners of the same prologue at a similar N (not measured on those shapes themselves)."""
    if name == "norm":
        return (32, 256, 8) if n >= 8192 else (8, 512, 4)
    if name == "silu":
        return 8, 512, 4
    return table.gemv_default


# SiLU + down in fp16 (the V100's dtype) takes the table's ``fp16_silu``: (8, 512, 4), the bf16 winner, ran 14-18 %
# slower in fp16 than in bf16 on every down shape measured; (4, 512, 4) runs fp16 within 1-2 % of bf16's best (H200,
# 2026-12-04, tests/fixtures/engine/h200-fp16-silu-blocks-2026-12-04.json)


def prologue_blocks(name: str, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """The blocks launch_prologue takes for a prologue product of n x k in ``dtype`` when none are given."""
    table = tuning.active()
    if name == "silu" and dtype == torch.float16:
        return table.fp16_silu
    return table.prologue.get((name, n, k)) or _prologue_default(name, n, table)


def launch_prologue(prologue: int, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
                    delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                    x_out: torch.Tensor | None = None, blocks: tuple[int, int, int] | None = None,
                    send=None, zc: bool = False) -> torch.Tensor:
    """out [N] = w [N, K] @ h (+ b), h made from x by the prologue (x: [K]; [2K] = [gate | up] for SiLU);
    PROLOGUE_NORM writes x + delta into x_out [K].
    ``send`` (engine.allreduce.epilogue.Ticket): out's rows also go, tagged, into the peer's inbox."""
    n, k = w.shape
    name = PROLOGUE_NAMES[prologue]
    if prologue == PROLOGUE_PLAIN:
        table = tuning.active()
        bn, bk, warps = blocks or table.gemv.get((n, k), table.gemv_default)
    else:
        bn, bk, warps = blocks or prologue_blocks(name, n, k, x.dtype)
    if interpreting() and blocks is None:
        bn = 32  # the interpreter runs programs one after another: fewer, wider ones
    peer, ser, slot, e = ticket_args(send, out)
    stats_block = min(8192, 1 << (k - 1).bit_length())
    from engine.kernels import gemv_jit

    gemv_jit.gemv_prologue_kernel[(-(-n // bn),)](
        w, x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        b if b is not None else w, out, x_out if x_out is not None else out, n, k, w.stride(0), float(eps),
        peer, ser, slot, e,
        PROLOGUE=prologue, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        EMU=interpreting() and x.dtype == torch.bfloat16, STATS_BLOCK=stats_block,
        SEND=send is not None, EPW=epw(out.dtype), ZC=zc,
        num_warps=warps)
    return out


def linear_norm(x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                b: torch.Tensor | None = None, zc: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) @ w^T + b, x + delta) for one row x, delta [1, 1, K]: one kernel.
    ``zc``: the zero-centred norm (weight applied as 1 + w, Qwen3.5). A packed (GPTQ / AWQ) ``w`` runs its own
    (engine.core.quant's PackedLinear.linear_norm: engine.kernels.gemv_int4's kernel, the same prologue; a Rows of
    packed parts beside dense ones: each part's kernel)."""
    if not isinstance(w, torch.Tensor):
        return w.linear_norm(x, delta, norm_weight, eps, b, zc=zc)
    k = w.shape[1]
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    x_out = torch.empty(k, dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_NORM, x.reshape(-1).contiguous(), w, b, out, delta.reshape(-1).contiguous(),
                    norm_weight, eps, x_out, zc=zc)
    return out.view(*x.shape[:-1], w.shape[0]), x_out.view(x.shape)


def linear_silu(gu: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, send=None):
    """(SiLU(gate) * up) @ w^T + b for one row gu [1, 1, 2K] = [gate | up]: one kernel. With ``send`` (a
    Ticket) the rows also go to the peer and the result is an engine.allreduce.epilogue.Sent. A packed ``w`` runs its
    own (PackedLinear.linear_silu)."""
    if not isinstance(w, torch.Tensor):
        return w.linear_silu(gu, b, send)
    out = torch.empty(w.shape[0], dtype=gu.dtype, device=gu.device)
    launch_prologue(PROLOGUE_SILU, gu.reshape(-1).contiguous(), w, b, out, send=send)
    return as_sent(out.view(*gu.shape[:-1], w.shape[0]), send)


def linear_send(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, send=None):
    """x [1, 1, K] @ w^T + b (the prologue kernel, plain); with ``send`` (a Ticket) its rows also go to the peer
    and the result is an engine.allreduce.epilogue.Sent. A packed ``w`` runs its own (PackedLinear.linear_send)."""
    if not isinstance(w, torch.Tensor):
        return w.linear_send(x, b, send)
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    launch_prologue(PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out, send=send)
    return as_sent(out.view(*x.shape[:-1], w.shape[0]), send)


def launch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
           blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """out [N] = w [N, K] @ x [K] (+ b): the plain GEMV's raw launch (x, w contiguous; out preallocated)."""
    return launch_prologue(PROLOGUE_PLAIN, x, w, b, out, blocks=blocks)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for the decode step: the Triton GEMV when x is one row on a CUDA device, else F.linear (a packed
    weight: its own products, engine.core.quant.PackedLinear.linear)."""
    if not isinstance(w, torch.Tensor):
        return w.linear(x, b)
    if x.device.type != "cuda" or x.numel() != w.shape[1]:
        return F.linear(x, w, b)
    out = torch.empty(w.shape[0], dtype=x.dtype, device=x.device)
    return launch(x.reshape(-1).contiguous(), w, b, out).view(*x.shape[:-1], w.shape[0])


# ---- the one-query attention -----------------------------------------------------------------------------------
BLOCK_S = 128  # cache positions per tile (H200, 2026-11-30: 128 x 8 warps fastest of 8 configurations)
NUM_WARPS = 8
TARGET_PROGRAMS = 264  # about two programs per SM of an H200 (132 SMs): sets how the window is split
# head dim 256 (Qwen3.5): 64-position tiles and 4 warps: 197 vs 232 us at 128K, 365 vs 419 us at 256K against
# (128, 8) on an H200 (2026-12-01, python -m engine.bench.attention, tests/fixtures/engine/h200-attention-2026-12-01.json)
HD256_CONFIG = (64, 4, 0)
# tiles whose loads a program keeps in flight (the launch's num_stages): 1 = none. Triton's default (3) needs
# 3 x 128 KB of shared memory at head dim 256 and 128-position tiles: more than an H200 has (227 KB).
STAGES = 1
# long windows (>= LONG_WINDOW positions) on cards with cp.async (compute capability >= 8.0): head dim -> (positions
# per tile, warps, num_stages): Triton's pipeline three tiles deep on small tiles. H200, 2026-12-02 (python -m
# engine.bench.attention, tests/fixtures/engine/h200-attention-2026-12-02.json): 27B shape 172.8 / 309.4 us at 128K /
# 256K (74 % / 83 % of read bandwidth) against 196.8 / 364.1 us for HD256_CONFIG; 8B shape 153.1 / 284.2 us (82 % /
# 89 %) against 261.5 / 356.4 us for (BLOCK_S, NUM_WARPS). int8 caches, 2026-12-03 (h200-attention-2026-12-03-apart-*):
# the same blocks with APART were the fastest of the sweep (27B 149.0 us at 128K against 230.6 us before).
LONG_WINDOW = 65536
LONG_CONFIG = {128: (64, 4, 3), 256: (32, 4, 3)}
# the step's own position attended apart from the cache tiles (decode_attention's ``apart``) whenever the loop is
# pipelined (num_stages > 1): the tiles then go from memory to the products untouched, so an int8 tile is widened in
# the products' register layout instead of through shared memory a second time. H200, 2026-12-03
# (tests/fixtures/engine/h200-attention-2026-12-03-apart-*.json, docs/engine-speed.md): with 3 stages 27B bf16 172.2
# -> 154.7 us at 128K, int8 214.5 -> 149.0 us; with 1 stage it loses (194.6 -> 224.8 us), so it is off there
APART = True
# int8 caches in fp16 on a GPU widened by a byte permute (attention_jit._i8_to) instead of Triton's cvt per value:
# exact (tests/engine/test_engine_fused_gpu.py, passed on an H200) and faster there (27B 163.2 -> 149.4 us at 128K)
I8_PERMUTE = True
VOLTA_TILE = 128 * 128  # positions per tile x head dim at most below compute capability 8.0 (engine.core.sm70)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def _counter(k_cache: torch.Tensor, n_kv: int) -> torch.Tensor:
    """One arrival counter per kv head of this cache (zero between calls: the combining program resets it).
    Made on the first call, which every caller runs before capturing a graph."""
    key = (k_cache.device, k_cache.data_ptr(), n_kv)
    c = _COUNTERS.get(key)
    if c is None:
        if k_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_attention: call it once before capturing a CUDA graph")
        c = _COUNTERS[key] = torch.zeros(n_kv, dtype=torch.int32, device=k_cache.device)
    return c


def splits_for(window: int, n_kv: int, block_s: int = BLOCK_S) -> tuple[int, int]:
    """(programs per kv head, cache positions per program) for a window: about TARGET_PROGRAMS programs in
    all, each over a whole number of tiles."""
    tiles = -(-window // block_s)
    want = max(1, min(tiles, -(-TARGET_PROGRAMS // n_kv)))
    chunk = -(-tiles // want) * block_s
    return -(-window // chunk), chunk


def launch_config(hd: int, window: int, capability: tuple[int, int] | None, *, block_s: int | None = None,
                  num_warps: int | None = None, stages: int | None = None,
                  apart: bool | None = None) -> tuple[int, int, int, int, bool]:
    """(positions per tile, warps, programs per kv head or 0 for splits_for, num_stages, apart) that
    decode_attention launches for head dim ``hd`` over ``window`` positions on a GPU of ``capability`` (None: not
    a GPU, Triton's interpreter); arguments given win over the defaults. 16-bit and int8 caches take the same."""
    table = tuning.active().attention  # a measured (tile, warps, programs) for this card family, or None
    cfg_bs, cfg_warps, cfg_splits = table or (HD256_CONFIG if hd >= 256 else (BLOCK_S, NUM_WARPS, 0))
    long = LONG_CONFIG.get(hd)
    if (long is not None and table is None and window >= LONG_WINDOW and block_s is None
            and num_warps is None and stages is None and capability is not None and capability >= (8, 0)):
        cfg_bs, cfg_warps, stages = long
    if block_s is None and cfg_bs * hd > VOLTA_TILE and capability is not None and capability < (8, 0):
        cfg_bs = VOLTA_TILE // hd  # a V100 block has 96 KB of shared memory: head dim 256 takes tiles of 64 (80 KB)
    stages = STAGES if stages is None else stages
    apart = (APART and stages > 1) if apart is None else apart
    return block_s or cfg_bs, num_warps or cfg_warps, cfg_splits, stages, apart


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                     q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, *, n_heads: int, n_kv: int, hd: int, eps: float, window: int,
                     combine: str = "last", splits: int | None = None, block_s: int | None = None,
                     num_warps: int | None = None, gated: bool = False, zc: bool = False,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     stages: int | None = None,
                     apart: bool | None = None, permute: bool | None = None,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [..., (n_heads + 2 n_kv) hd] (one row), cos/sin [1, hd] at pos, pos [1] (device int64) ->
    attention output [1, 1, n_heads hd] in qkv's dtype; K/V of pos written into the caches [1, kv, S, hd].
    ``combine``: "last" (the last program of a kv head combines, one kernel) or "kernel" (a second kernel);
    ``splits``: programs per kv head (default: splits_for); ``block_s``: positions per tile; defaults from
    the tuning table's ``attention`` (engine.tuning) or BLOCK_S, NUM_WARPS. Qwen3.5: ``gated`` (q rows
    [query | gate] per head, the output scaled by sigmoid(gate)), ``zc`` (zero-centred q/k norms) and a partial
    rotary (cos / sin narrower than the head: RoPE on its first cos.shape[-1] dimensions). An int8 cache comes
    with ``k_scale`` / ``v_scale`` [1, kv, S] float32 (engine.core.kvquant). ``stages``: tiles whose loads the
    loop keeps in flight (1: none; default STAGES); ``apart``: position
    pos attended after the tiles from registers instead of inside its tile (default: APART when stages > 1; the
    same scores, summed in another order); ``permute``: an int8 cache in fp16 widened by a byte permute (default
    I8_PERMUTE; exact either way). The launch's defaults: launch_config. ``slots`` [B] (device int64, distinct):
    the batched step's B rows at once (qkv [B, ...], cos / sin [B, rot], pos [B]; the caches and scales are the
    pools [slots, kv, S, hd] / [slots, kv, S], row b in pool row slots[b]) -> [B, 1, n_heads hd], each row what
    it gives alone, with the window's programs shared out over the rows."""
    from engine.kernels import attention_jit

    cap = torch.cuda.get_device_capability(qkv.device) if qkv.device.type == "cuda" else None
    block_s, num_warps, cfg_splits, stages, apart = launch_config(
        hd, window, cap, block_s=block_s, num_warps=num_warps, stages=stages, apart=apart)
    splits = splits or cfg_splits or None
    g = n_heads // n_kv
    g_pad = max(16, 1 << (g - 1).bit_length())
    bs = block_s
    rows = 1 if slots is None else qkv.shape[0]
    if splits is None:
        n_split, chunk = splits_for(window, n_kv * rows, bs)
    else:
        tiles = -(-window // bs)
        chunk = -(-tiles // splits) * bs
        n_split = -(-window // chunk)
    dev = qkv.device
    out = torch.empty(rows, n_heads * hd, dtype=qkv.dtype, device=dev)
    part_acc = torch.empty(rows * n_kv * n_split * g_pad * hd, dtype=torch.float32, device=dev)
    part_ml = torch.empty(rows * n_kv * n_split * 2 * g_pad, dtype=torch.float32, device=dev)
    one = combine == "last" or slots is not None  # the batched form combines in its last program only
    count = _counter(k_cache, n_kv * (1 if slots is None else ROWS_COUNTERS)) if one else part_ml
    if rows > ROWS_COUNTERS:
        raise ValueError(f"decode_attention: {rows} rows, at most {ROWS_COUNTERS}")
    extra = {} if slots is None else dict(
        slot_ptr=slots, row_qkv=qkv.stride(0), row_cs=cos.stride(0), slot_k=k_cache.stride(0),
        slot_v=v_cache.stride(0), slot_s=k_scale.stride(0) if k_scale is not None else 0, ROWS=True)
    qk = q_norm is not None
    emu = interpreting() and qkv.dtype == torch.bfloat16
    int8 = k_scale is not None
    permute = I8_PERMUTE if permute is None else permute
    attention_jit.attention_kernel[(n_kv, n_split, rows)](
        qkv.reshape(-1) if slots is None else qkv, cos.reshape(-1) if slots is None else cos,
        sin.reshape(-1) if slots is None else sin, pos, q_norm if qk else qkv, k_norm if qk else qkv,
        k_cache, v_cache, out, part_acc, part_ml, count, float(eps), 1.0 / math.sqrt(hd),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        N_HEADS=n_heads, N_KV=n_kv, G=g, G_PAD=g_pad, HD=hd, CHUNK=chunk, BLOCK_S=bs, SPLITS=n_split,
        QK_NORM=qk, DOT_F32=qkv.dtype == torch.float32 or interpreting(), ONE_KERNEL=one, EMU=emu,
        ROT=0 if cos.shape[-1] == hd else cos.shape[-1], GATED=gated, ZC=zc,
        ksc_ptr=k_scale if int8 else part_ml, vsc_ptr=v_scale if int8 else part_ml,
        stride_sh=k_scale.stride(1) if int8 else 0, INT8=int8, APART=apart,
        PERMUTE=bool(int8 and permute and qkv.dtype == torch.float16 and not interpreting()), num_stages=stages,
        num_warps=num_warps, **extra)
    if slots is not None:
        return out.view(rows, 1, n_heads * hd)
    if not one:
        attention_jit.combine_kernel[(n_kv,)](part_acc, part_ml, out, qkv.reshape(-1), SPLITS=n_split, G=g,
                                              G_PAD=g_pad, HD=hd, EMU=emu, GATED=gated, num_warps=4)
    return out.view(1, 1, n_heads * hd)


ROWS_COUNTERS = 64  # the batched form's arrival counters per cache pool: kv heads x this many rows (serve's N <= 64)


# ---- the Gated DeltaNet step -----------------------------------------------------------------------------------


def gdn_decode(proj: torch.Tensor, conv_ring: torch.Tensor, conv_w: torch.Tensor, a_log: torch.Tensor,
               dt_bias: torch.Tensor, gnorm: torch.Tensor, rec_state: torch.Tensor, pos: torch.Tensor, *, nk: int,
               nv: int, dk: int, dv: int, eps: float) -> torch.Tensor:
    """proj [conv channels + z + b + a] (one row) -> y [nv dv] in proj's dtype; conv ring and state updated."""
    from engine.kernels import gdn_decode_jit

    y = torch.empty(nv * dv, dtype=proj.dtype, device=proj.device)
    gdn_decode_jit.gdn_decode_kernel[(nv,)](
        proj.reshape(-1), conv_ring, conv_w, a_log, dt_bias, gnorm, rec_state, y, pos, float(eps), NK=nk, NV=nv,
        DK=dk, DV=dv, KSIZE=conv_w.shape[1], EMU=interpreting() and proj.dtype == torch.bfloat16,
        num_warps=8 if dk * dv >= 8192 else 4)
    return y


def gdn_decode_rows(proj: torch.Tensor, rings: torch.Tensor, conv_w: torch.Tensor, a_log: torch.Tensor,
                    dt_bias: torch.Tensor, gnorm: torch.Tensor, recs: torch.Tensor, pos: torch.Tensor,
                    slots: torch.Tensor, *, nk: int, nv: int, dk: int, dv: int, eps: float) -> torch.Tensor:
    """gdn_decode for B sequences (the batched step): proj [B, conv channels + z + b + a] (row b: the sequence in
    pool row slots[b] at pos[b]) -> y [B, nv dv]; each row's ring (rings [slots, C, K]) and state (recs [slots, nv,
    dk, dv]) updated in place, by the same kernel as one row (programs per value head and row): no gather, no
    scatter."""
    from engine.kernels import gdn_decode_jit

    if not (rings.is_contiguous() and recs.is_contiguous() and proj.stride(-1) == 1):
        raise ValueError("gdn_decode_rows: the ring and state pools must be contiguous, proj's rows dense")
    b = proj.shape[0]
    y = torch.empty(b, nv * dv, dtype=proj.dtype, device=proj.device)
    gdn_decode_jit.gdn_decode_kernel[(nv, b)](
        proj, rings, conv_w, a_log, dt_bias, gnorm, recs, y, pos, float(eps), NK=nk, NV=nv, DK=dk, DV=dv,
        KSIZE=conv_w.shape[1], EMU=interpreting() and proj.dtype == torch.bfloat16, slot_ptr=slots,
        proj_stride=proj.stride(0), ROWS=True, num_warps=8 if dk * dv >= 8192 else 4)
    return y
