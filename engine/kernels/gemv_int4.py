"""The decode step's one-row products on packed 4-bit weights (engine.core.quant.PackedLinear), in Triton.

y [N] = W [N, K] @ h [K] with W read as it is held: int32 words of eight 4-bit values along K, a 4-bit zero point
and a scale per (group, output):
    y[n] = sum over groups g of s[g, n] * sum over the group's words i of (sum_j q[n, 8i + j] h[8i + j] - z[g, n] hw[i])
so the bytes read are the packed weights, the zero points and the scales, nothing dequantised. Two kernels a call:
- ``int4_row_kernel`` makes the input row h once (K / SUB programs, SUB = min(BLOCK_K, group)): the same prologues as
  engine.kernels.decode's bf16 GEMV (kernel choice "fused": residual add + RMSNorm with Hugging Face's rounding, or
  SiLU(gate) * up, or h = x; a desc_act input order read at perm[k]), written in "plane order" (per tile, the j-th
  input of every word together, scaled by 16^-j') as float32, with each word's sum of h (hw, for the zero points).
- ``int4_gemv_kernel``: each program owns BLOCK_N rows and a slice of K (split-K: ``split`` programs along K) and
  walks it a tile (one group's words at most) at a time: 16-byte loads of the words, then per plane j
  ``(word & 0xF << 4j) | 2^23`` as a float minus 2^23, i.e. q x 16^j exactly with no int-to-float conversion and no
  reshape (nibbles 5..7 from the word shifted by 12), times plane j of h; the group's scale and zero point once per
  word. ``stages`` 2 loads the next tile before this tile's arithmetic. With split-K the last program of a row block
  to finish adds the slices' sums in slice order (the same result whichever finishes last) and runs the epilogue:
  bias, rounding, and optionally the rows, tagged, to the peer's inbox (the TP2 exchange of
  engine.allreduce.epilogue, mode "send"). float32 sums in a fixed order: bit-identical ranks and graph replays.

For 16-bit activations the default is the fp16-pairs form (blocks[5] = FORM_PAIRS): the row kernel writes h as
fp16 pairs scaled per tile by a power of two (and the tile's factor), and the GEMV makes two nibbles per LOP3
(``& 0x000F000F | 0x64006400`` read as two fp16 is 1024 + q), takes 1024 + z off and multiplies by h in f16x2
arithmetic (inline PTX, an fp16x2 partial per word, float32 across words), ~2.7 SASS instructions per nibble against
~5.2 for the planes; the interpreter runs the same operands in float32 (``_pair_word``). float32 activations always
take the planes form. The kernels are engine.kernels.gemv_int4_jit's.

Options measured slower and deleted (the subnormal-pairs form, words in quads, two tiles ahead, a persistent
grid, Triton's cp.async pipeline): docs/engine-speed.md, history.

Prefill chunks do not come here: PackedLinear.linear dequantises the matrix for the chunk (``dequantise``, one
Triton kernel) and multiplies with cuBLAS.
"""

from __future__ import annotations

import functools

import torch

from engine import tuning
from engine.kernels.exchange import as_sent, epw, ticket_args
from engine.kernels.int4_pack import TILE_WORDS
from engine.kernels.interpreter import interpreting
from engine.kernels.prologue import PROLOGUE_NAMES, PROLOGUE_NORM, PROLOGUE_PLAIN, PROLOGUE_SILU

# Blocks per (prologue, N, K): the tuning table's ``int4`` (engine.tuning; bench: python -m engine.bench.int4
# --write-table), (BLOCK_N, BLOCK_K, num_warps, split, stages, form); _default_blocks for a matrix it does not list.
FORM_PLANES, FORM_PAIRS = 0, 1  # blocks[5]: the loop's form for 16-bit activations (float32 ones: planes)
DEFAULT_FORM = FORM_PAIRS
PAIR_DTYPES = (torch.bfloat16, torch.float16)
DEFAULT_STAGES = 2  # 2: the next tile's loads issued before this tile's arithmetic (registers); 1: not
TILE_ROWS = 32  # packed matrices on a GPU hold their words in tiles of this many rows (PackedLinear.tiled); 0: rows
TILE_DEVICES = ("cuda",)  # where loading tiles them (the CPU's products read rows)


def _default_blocks(n: int, k: int) -> tuple[int, ...]:
    """Blocks for a matrix the table does not list, by its height (a rule read off the 2026-12-04 sweep, within 6 %
    of the fastest on every matrix of it): four-warp programs of 64 rows; 1024 rows or fewer, K in 32 slices
    (enough programs for a short matrix), else in 8 (never more slices than tiles of 128 inputs). Tiles of 128
    inputs fetched one ahead, the pairs form."""
    split = 32 if n <= 1024 else 8
    return 64, 128, 4, max(1, min(split, k // 128)), 2, FORM_PAIRS


@functools.cache
def _triton_pdl() -> bool:
    """Whether this Triton launches with programmatic dependent launch and has grid dependency control."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_PDL = [True]  # use_pdl's switch: this module reads no environment


def use_pdl(on: bool) -> bool:
    """Allow (the default) or forbid PDL in every launch from now on: engine.core.runner's Decoder sets it once, when
    it is built, from its DecodeMode (its argument, else V100PLAN_ENGINE_INT4_PDL read then), as it makes its tuning
    table active."""
    _PDL[0] = bool(on)
    return _PDL[0]


def pdl_enabled(device: torch.device) -> bool:
    """The GEMV launched while its row kernel still runs (programmatic dependent launch): on compute capability
    9.0 and later (Hopper's grid dependency control), with a Triton that has it, not under the interpreter, and
    unless use_pdl(False). The GEMV loads its first tile's words, then waits for the row kernel."""
    if not _PDL[0] or device.type != "cuda" or interpreting():
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and _triton_pdl()


def held(w, device: torch.device):
    """A packed matrix as the GEMV on ``device`` reads it best: in tiles of TILE_ROWS rows on a GPU (words in
."""
    if TILE_ROWS and torch.device(device).type in TILE_DEVICES:
        return w.tiled(TILE_ROWS)
    return w


def _tb(w) -> int:
    """The kernels' TB for a packed matrix: 0 in rows, else the tile's rows."""
    return w.tile_rows


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Split-K's per-row-block arrival counters on this device: zeros, and left at zero by every launch (the last
    program of a block resets its counter), so one buffer serves every matrix and every graph replay."""
    key = (device.type, device.index)
    have = _COUNTERS.get(key)
    if have is None or have.numel() < blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("int4 GEMV: split-K counters must exist before graph capture (run the step once)")
        have = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = have
    return have


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def row_input(prologue: int, x: torch.Tensor, w, sub: int, delta: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, x_out: torch.Tensor | None = None,
              zc: bool = False, pairs: bool = False, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV's input (int4_row_kernel): h in plane order per ``sub`` inputs, float32, and each word's sum of
    h; NORM writes x + delta into x_out. ``pairs``: h as fp16 pairs (two in each float32's bits, sub / 2 per
    tile) and one factor per tile instead. ``pdl``: the next kernel (a GEMV launched with PDL) may start at once."""
    k = w.in_features
    nchunks = -(-k // sub)
    per = sub // (2 if pairs else 1)
    hp = torch.empty(nchunks * per, dtype=torch.float32, device=x.device)
    hw = torch.empty(nchunks * (1 if pairs else sub // 8), dtype=torch.float32, device=x.device)
    from engine.kernels import gemv_int4_jit

    gemv_int4_jit.int4_row_kernel[(nchunks,)](
        x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
        w.perm if w.perm is not None else w.qweight, x_out if x_out is not None else hp, hp, hw, k, float(eps),
        PROLOGUE=prologue, HAS_PERM=w.perm is not None, SUB=sub, EMU=interpreting() and x.dtype == torch.bfloat16,
        STATS_BLOCK=min(8192, _pow2_at_least(k)), ZC=zc, PAIRS=pairs, PDL=pdl, num_warps=4)
    return hp, hw


def launch(prologue: int, x: torch.Tensor, w, b: torch.Tensor | None, out: torch.Tensor,
           delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
           x_out: torch.Tensor | None = None, blocks: tuple[int, ...] | None = None, send=None,
           zc: bool = False) -> torch.Tensor:
    """out [N] = W @ h (+ b), h made from x by the prologue (engine.kernels.prologue's PLAIN / NORM / SILU; x: [K],
    or [2K] = [gate | up] for SiLU); NORM writes x + delta into x_out [K]. ``send``: as decode.launch_prologue's.
    ``blocks``: (BLOCK_N, BLOCK_K, num_warps[, split[, stages[, form]]]): split = programs along K
    (split-K, default 1), stages = the depth of the loop's load pipeline (DEFAULT_STAGES), form = FORM_PAIRS (fp16
    pairs, 16-bit activations only) or FORM_PLANES (float32 planes; float32 activations always), DEFAULT_FORM."""
    n, k = w.shape
    name = PROLOGUE_NAMES[prologue]
    cfg = tuple(blocks or tuning.active().int4.get((name, n, k)) or _default_blocks(n, k))
    bn, bk, warps = cfg[:3]
    split = cfg[3] if len(cfg) > 3 else 1
    stages = cfg[4] if len(cfg) > 4 else DEFAULT_STAGES
    form = cfg[5] if len(cfg) > 5 else DEFAULT_FORM
    if stages not in (1, 2) or form not in (FORM_PLANES, FORM_PAIRS):
        raise ValueError(f"int4 GEMV: blocks {cfg}: stages must be 1 or 2 and form 0 (planes) or 1 (pairs)")
    pairs = x.dtype in PAIR_DTYPES and form == FORM_PAIRS
    if interpreting() and blocks is None:
        bn = 32  # the interpreter runs programs one after another: fewer, wider ones
    bk = min(bk, _pow2_at_least(k))
    if w.tile_rows:
        bk = min(bk, 8 * TILE_WORDS)  # a tile inside one held tile
    gs = w.group_size if w.group_size < k else -(-k // bk) * bk  # one group over all inputs: whole tiles of it
    sub = min(bk, gs)
    if stages >= 2:
        bk = sub  # the prefetching loops take one group's tile at a time
    if gs % sub or bk % sub or sub % 8 or sub & (sub - 1):
        raise ValueError(f"int4 GEMV: BLOCK_K {bk} and group size {gs} must nest (powers of two, at least 8)")
    tiles = -(-k // bk)
    split = max(1, min(split, tiles))
    ks = -(-tiles // split) * bk  # inputs per slice: whole tiles (so whole groups, or whole tiles of one group)
    split = -(-k // ks)
    grid_n = -(-n // bn)
    part = counters = out
    if split > 1:
        part = torch.empty(split * n, dtype=torch.float32, device=out.device)
        counters = _counters(out.device, grid_n)
    pdl = pdl_enabled(out.device)
    hp, hw = row_input(prologue, x, w, sub, delta, norm_weight, eps, x_out if x_out is not None else out, zc, pairs,
                       pdl)
    emu = interpreting() and x.dtype == torch.bfloat16
    peer, ser, slot, e = ticket_args(send, out)
    from engine.kernels import gemv_int4_jit

    gemv_int4_jit.int4_gemv_kernel[(grid_n, split)](
        w.qweight, w.qzeros, w.scales, hp, hw, b if b is not None else out, out, part, counters, n, k, k // 8, ks // 8,
        peer, ser, slot, e, HAS_BIAS=b is not None, BLOCK_N=bn, BLOCK_K=bk, GS=gs, ZOFF=w.zero_offset, EMU=emu,
        SEND=send is not None, EPW=epw(out.dtype), SPLIT=split, EVEN_K=k % bk == 0 and ks % bk == 0,
        STAGES=stages, PAIRS=pairs, ASM=not interpreting(), EVEN_N=n % bn == 0, TB=_tb(w),
        TW=TILE_WORDS, PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return out


def linear(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ W^T + b."""
    out = torch.empty(w.out_features, dtype=x.dtype, device=x.device)
    launch(PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out)
    return out.view(*x.shape[:-1], w.out_features)


def linear_norm(x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, w, b: torch.Tensor | None = None,
                zc: bool = False):
    """decode.linear_norm for a packed weight: (RMSNorm(x + delta) @ W^T + b, x + delta), one kernel. ``delta`` must
    be a tensor: the receiving exchange (mode "gemv") is not offered for packed weights. ``zc``: the zero-centred
    norm (Qwen3.5)."""
    if not isinstance(delta, torch.Tensor):
        raise ValueError("packed weights: the exchange is received by its own kernel (exchange mode 'send' or "
                         "'kernel', not 'gemv')")
    k = w.in_features
    out = torch.empty(w.out_features, dtype=x.dtype, device=x.device)
    x_out = torch.empty(k, dtype=x.dtype, device=x.device)
    launch(PROLOGUE_NORM, x.reshape(-1).contiguous(), w, b, out, delta.reshape(-1).contiguous(), norm_weight,
           eps, x_out, zc=zc)
    return out.view(*x.shape[:-1], w.out_features), x_out.view(x.shape)


def linear_silu(gu: torch.Tensor, w, b: torch.Tensor | None = None, send=None):
    """decode.linear_silu for a packed weight."""
    out = torch.empty(w.out_features, dtype=gu.dtype, device=gu.device)
    launch(PROLOGUE_SILU, gu.reshape(-1).contiguous(), w, b, out, send=send)
    return as_sent(out.view(*gu.shape[:-1], w.out_features), send)


def linear_send(x: torch.Tensor, w, b: torch.Tensor | None, send=None):
    """decode.linear_send for a packed weight."""
    out = torch.empty(w.out_features, dtype=x.dtype, device=x.device)
    launch(PROLOGUE_PLAIN, x.reshape(-1).contiguous(), w, b, out, send=send)
    return as_sent(out.view(*x.shape[:-1], w.out_features), send)


def dequantise(w, dtype: torch.dtype, blocks: tuple[int, int] = (32, 128)) -> torch.Tensor:
    """W [N, K] in the held input order, for a prefill chunk's GEMM (made per call, freed after it)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=dtype, device=w.device)
    gs = w.group_size if w.group_size < k else _pow2_at_least(k)
    from engine.kernels import gemv_int4_jit

    gemv_int4_jit.dequant_kernel[(-(-n // blocks[0]), -(-k // blocks[1]))](
        w.qweight, w.qzeros, w.scales, out, n, k, GS=gs, ZOFF=w.zero_offset, BLOCK_N=blocks[0], BLOCK_K=blocks[1],
        TB=_tb(w), TW=TILE_WORDS)
    return out


# ---- the batched GEMV: 2..16 rows (continuous batching's decode step), each weight word read once ----------------
ROWS_MAX = 16  # PackedLinear.linear on a GPU: 2..ROWS_MAX rows here, more (a prefill chunk) dequantise + cuBLAS
ROWS_FMA, ROWS_DOT = 0, 1  # launch_rows' blocks[4]: float32 broadcast multiply-adds, or tl.dot on 16-bit tiles
DOT_MIN_ROWS = 16  # tl.dot's least dimension: the DOT form pads the rows to 16 whatever M is
ROWS_STAGES = 1  # launch_rows' blocks[5] when they name none: 1 = each tile's loads then its arithmetic
ROWS_PROGRAMS = 512  # the default split-K aims at this many programs (about four per SM of an H100's 132)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _rows_default_blocks(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """Blocks (BLOCK_N, BLOCK_K, num_warps, split, form) of the batched GEMV for a matrix of n x k and m rows. NOT
    MEASURED YET (no sweep of this kernel has been run; engine.bench.int4_rows times these and a few others): the
    DOT form (tensor cores) for 16-bit activations on compute capability 8.0 and later and under the interpreter,
    tiles of 64 rows x 128 inputs, four warps; the FMA form for float32 activations and on the V100 (its tl.dot is
    FMA code over 16 padded rows: M_PAD FMAs per weight instead), with BLOCK_N x M_PAD x 16 words = 2048 products
    a tile. Split-K only to reach about ROWS_PROGRAMS programs (each slice's partial sums are M x N float32 written
    and read back), never past the tiles of 128 inputs."""
    dot = dtype in PAIR_DTYPES and (device.type != "cuda" or _capability(device.index) >= (8, 0))
    if dot:
        bn = 64
    else:
        bn = max(8, min(64, 2048 // (_pow2_at_least(m) * 16)))
    grid_n = -(-n // bn)
    split = max(1, min(-(-ROWS_PROGRAMS // grid_n), k // 128))
    return bn, 128, 4, split, ROWS_DOT if dot else ROWS_FMA, ROWS_STAGES


def launch_rows(x: torch.Tensor, w, b: torch.Tensor | None, out: torch.Tensor,
                blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """out [M, N] = x [M, K] @ W^T (+ b) for 1 <= M <= ROWS_MAX rows (x contiguous, in the module's input order; a
    desc_act order is applied in the kernel): engine.kernels.gemv_int4_rows_jit.int4_rows_kernel, one launch, each
    weight word, zero point and scale read once for all M rows. ``blocks``: (BLOCK_N, BLOCK_K, num_warps[, split[,
    form[, stages]]]) with form ROWS_DOT (tl.dot, rows padded to 16; float32 activations multiply in IEEE float32)
    or ROWS_FMA (the default form when blocks name none), stages 2 (the next tile's loads before this tile's
    arithmetic) or 1 (ROWS_STAGES when blocks name none); blocks None: _rows_default_blocks. Each output is a float32
    sum of the exact products (q - z) x per tile, times the group's scale, summed over tiles and split-K slices in a
    fixed order, plus the bias, rounded once to out's dtype: the M = 1 GEMV's rounding. Row m differs from the M = 1
    GEMV's output on that row only through the float32 summation order (and, on a GPU in 16 bits, the M = 1 pairs
    form's fp16 partial per word), so by at most a unit in the last place of out's dtype where the float32 sums
    straddle a rounding boundary (tests/engine_int4_rows_cases.py)."""
    m, k = x.shape
    n = w.out_features
    if not 1 <= m <= ROWS_MAX or k != w.in_features:
        raise ValueError(f"int4 rows GEMV: x {tuple(x.shape)} for a {n} x {w.in_features} matrix (1..{ROWS_MAX} rows)")
    cfg = tuple(blocks or _rows_default_blocks(n, k, m, x.dtype, x.device))
    bn, bk, warps = cfg[:3]
    split = cfg[3] if len(cfg) > 3 else 1
    form = cfg[4] if len(cfg) > 4 else ROWS_FMA
    stages = cfg[5] if len(cfg) > 5 else ROWS_STAGES
    if form not in (ROWS_FMA, ROWS_DOT) or stages not in (1, 2):
        raise ValueError(f"int4 rows GEMV: blocks {cfg}: form must be 0 (FMA) or 1 (DOT), stages 1 or 2")
    dot = form == ROWS_DOT
    bk = min(bk, _pow2_at_least(k))
    if w.tile_rows:
        bk = min(bk, 8 * TILE_WORDS)  # a tile inside one held tile
    gs = w.group_size if w.group_size < k else -(-k // bk) * bk  # one group over all inputs: whole tiles of it
    bk = min(bk, gs)  # a tile inside one group: its scale and zero point apply to the whole tile
    if gs % bk or bk % 8 or bk & (bk - 1) or (dot and bk < 16):
        raise ValueError(f"int4 rows GEMV: BLOCK_K {bk} and group size {gs} must nest (powers of two, at least 8; "
                         f"16 for the DOT form)")
    tiles = -(-k // bk)
    split = max(1, min(split, tiles))
    ks = -(-tiles // split) * bk
    split = -(-k // ks)
    grid_n = -(-n // bn)
    part = counters = out
    if split > 1:
        part = torch.empty(split * m * n, dtype=torch.float32, device=out.device)
        counters = _counters(out.device, grid_n)
    m_pad = max(DOT_MIN_ROWS if dot else 1, _pow2_at_least(m))
    interp = interpreting()
    from engine.kernels import gemv_int4_rows_jit

    gemv_int4_rows_jit.int4_rows_kernel[(grid_n, split)](
        w.qweight, w.qzeros, w.scales, x, w.perm if w.perm is not None else w.qweight, b if b is not None else out,
        out, part, counters, m, n, k, k // 8, ks // 8, HAS_BIAS=b is not None, HAS_PERM=w.perm is not None,
        M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, GS=gs, ZOFF=w.zero_offset, DOT=dot,
        DOT_F32=dot and (interp or x.dtype == torch.float32), EMU=interp and x.dtype == torch.bfloat16, SPLIT=split,
        EVEN_K=k % bk == 0, EVEN_N=n % bn == 0, TB=_tb(w), TW=TILE_WORDS, STAGES=stages, num_warps=warps)
    return out


ONE_ROW_UPTO = [0]  # linear_rows runs M <= this many rows as M one-row GEMVs (launch), not the batched GEMV


def linear_rows(x: torch.Tensor, w, b: torch.Tensor | None = None, blocks: tuple[int, ...] | None = None):
    """x [..., K] with 1..ROWS_MAX rows @ W^T + b through the batched GEMV (launch_rows), [..., N] in x's dtype;
    up to ONE_ROW_UPTO[0] rows, one row at a time through the one-row GEMV (launch) instead."""
    k = w.in_features
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], w.out_features, dtype=x.dtype, device=x.device)
    if x2.shape[0] <= ONE_ROW_UPTO[0] and blocks is None:
        for r in range(x2.shape[0]):
            launch(PROLOGUE_PLAIN, x2[r], w, b, out[r])
    else:
        launch_rows(x2, w, b, out, blocks)
    return out.view(*x.shape[:-1], w.out_features)
