"""4-bit groupwise weights as users download them (GPTQ, AWQ): the config, the packed weight, its products.

A checkpoint's ``quantization_config`` is parsed by ``parse`` (QuantError naming the field for anything this
engine cannot run). Each quantised module becomes one ``PackedLinear`` that stays packed where the model
lives: 4-bit values eight to an int32 word, one scale and one 4-bit zero point per group of ``group_size``
inputs and output. Nothing dequantised is kept: the products dequantise as they go.

The checkpoint layouts (W is the module's [out N, in K] weight; q the 4-bit values, z the zero points,
s the scales; w[n, k] = s[g(k), n] * (q[n, k] - z[g(k), n]), g(k) = g_idx[k], else k // group_size):

  GPTQ (AutoGPTQ / GPTQModel, checkpoint_format "gptq"):
    qweight int32 [K / 8, N]: nibble j of word [i, n] is q[n, 8 i + j]
    qzeros  int32 [G, N / 8]: nibble j of word [g, c] is z[g, 8 c + j] - 1 ("v1": stored minus one, so a
                              zero point of 0 cannot be written; "gptq_v2" stores z itself)
    scales  fp16  [G, N];  g_idx int32 [K] (desc_act: the input order the quantiser walked, per input)
  AWQ (AutoAWQ, version "gemm"):
    qweight int32 [K, N / 8]: nibble i of word [k, c] is q[8 c + AWQ_ORDER[i], k]
    qzeros  int32 [G, N / 8]: the same order, z itself;  scales fp16 [G, N]; no g_idx

Held here as one layout for both (the kernels' layout; the same bytes as the file's tensors):
    qweight int32 [N, K / 8]  nibble j of word [n, i] = q[n, 8 i + j]  (rows of W, as the bf16 GEMV reads W)
    qzeros  int32 [G, N / 8]  nibble j of word [g, c] = stored z[g, 8 c + j]; ``zero_offset`` added (1 for v1)
    scales        [G, N]      as stored (fp16)
    perm    int32 [K] or None an input order that makes groups contiguous (desc_act): input column c of the
                              held weight is the module's input perm[c]; None when g(k) = k // group_size.

On a GPU the words are held in tiles (``PackedLinear.tiled``, ``tile_rows`` = TB > 0): the same [N, K / 8] tensor's
memory ordered [N / TB, K / 8 / TILE_WORDS, TB, TILE_WORDS], so the tile of TB rows x TILE_WORDS words (128 inputs)
the decode GEMV reads at a time is one contiguous 2 KB run instead of TB runs of 64 bytes a row apart (a DRAM row
opened per 64 bytes). Word (n, i) sits at (n // TB) TB K/8 + (i // TILE_WORDS) TILE_WORDS TB + (n % TB) TILE_WORDS
+ i % TILE_WORDS; ``row_words`` gives the row layout back (the CPU products, fusing, the reference).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from engine.core.quant_config import QuantConfig, QuantError, check_inputs, parse  # noqa: F401 (re-exported)
from engine.kernels.int4_pack import TILE_WORDS, awq_to_natural, pack, unpack

PARTS = ("qweight", "qzeros", "scales", "g_idx")  # a module with a qweight is quantised; one with weight dense


# ---- the packed weight ------------------------------------------------------------------------------------
class PackedLinear:
    """One quantised matrix [out_features, in_features] of this rank, packed (see the module docstring)."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, perm: torch.Tensor | None,
                 group_size: int, zero_offset: int, fmt: str, tile_rows: int = 0):
        self.qweight, self.qzeros, self.scales, self.perm = qweight, qzeros, scales, perm
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 8
        self.group_size = group_size if group_size != -1 else self.in_features
        self.zero_offset, self.format = zero_offset, fmt
        self.tile_rows = tile_rows  # 0: qweight in rows; TB > 0: held in tiles of TB rows (module docstring)

    def can_tile(self, rows: int) -> bool:
        return rows > 0 and self.out_features % rows == 0 and (self.in_features // 8) % TILE_WORDS == 0

    def tiled(self, rows: int) -> PackedLinear:
        """The same matrix with its words held in tiles of ``rows`` rows (the module docstring); self if it cannot
        be (N not a multiple of rows, K not of 128) or already is."""
        if self.tile_rows or not self.can_tile(rows):
            return self
        n, kw = self.qweight.shape
        t = self.qweight.view(n // rows, rows, kw // TILE_WORDS, TILE_WORDS).permute(0, 2, 1, 3)
        return PackedLinear(t.contiguous().view(n, kw), self.qzeros, self.scales, self.perm, self.group_size,
                            self.zero_offset, self.format, rows)

    def row_words(self) -> torch.Tensor:
        """qweight in the row layout [N, K / 8] (a copy when held in tiles)."""
        if not self.tile_rows:
            return self.qweight
        n, kw = self.qweight.shape
        tb = self.tile_rows
        return self.qweight.view(n // tb, kw // TILE_WORDS, tb, TILE_WORDS).permute(0, 2, 1, 3).reshape(n, kw)

    def untiled(self) -> PackedLinear:
        if not self.tile_rows:
            return self
        return PackedLinear(self.row_words(), self.qzeros, self.scales, self.perm, self.group_size, self.zero_offset,
                            self.format)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.qzeros, self.scales, self.perm) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes held: packed weights, zero points, scales (and the input order, when there is one)."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> PackedLinear:
        move = [None if t is None else t.to(device) for t in (self.qweight, self.qzeros, self.scales, self.perm)]
        return PackedLinear(*move, self.group_size, self.zero_offset, self.format, self.tile_rows)

    def dequantise_held(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in the held input order (perm applied), computed in float32, rounded once to dtype."""
        n, k = self.shape
        q = unpack(self.row_words()).view(n, k // self.group_size, self.group_size).float()  # [N, G, gs]
        z = unpack(self.qzeros)[:, :n].t().float() + self.zero_offset  # [N, G]
        s = self.scales.t().float()  # [N, G]
        return ((q - z[:, :, None]) * s[:, :, None]).view(n, k).to(dtype)

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the module's weight [N, K] in its own input order (what transformers would hold)."""
        w = self.dequantise_held(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm.long()] = w
        return out

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ W^T + b. On a GPU, one row: the dequantising GEMV (engine.kernels.gemv_int4.linear); 2 to
        gemv_int4.ROWS_MAX (16) rows (a batched decode step): the batched GEMV (gemv_int4.linear_rows, each weight
        word read once for all rows); otherwise (a prefill chunk, the CPU) the chunk's product through the weight
        dequantised for this call only."""
        if x.device.type == "cuda" and x.numel() == self.in_features:
            from engine.kernels import gemv_int4

            return gemv_int4.linear(x, self, b)
        if x.device.type == "cuda" and x.numel() and x.shape[-1] == self.in_features:
            from engine.kernels import gemv_int4

            if x.numel() // self.in_features <= gemv_int4.ROWS_MAX:
                return gemv_int4.linear_rows(x, self, b)
        if self.perm is not None:
            x = x.index_select(-1, self.perm.long())
        if x.device.type == "cuda":
            from engine.kernels import gemv_int4

            return F.linear(x, gemv_int4.dequantise(self, x.dtype), b)
        return F.linear(x, self.dequantise_held(x.dtype), b)

    # the decode step's one-row products with a prologue (engine.kernels.decode's, which hands a packed weight here)
    def linear_norm(self, x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, b=None, zc: bool = False):
        from engine.kernels import gemv_int4

        return gemv_int4.linear_norm(x, delta, norm_weight, eps, self, b, zc=zc)

    def linear_silu(self, gu: torch.Tensor, b: torch.Tensor | None = None, send=None):
        from engine.kernels import gemv_int4

        return gemv_int4.linear_silu(gu, self, b, send)

    def linear_send(self, x: torch.Tensor, b: torch.Tensor | None, send=None):
        from engine.kernels import gemv_int4

        return gemv_int4.linear_send(x, self, b, send)


def cat(parts: list[PackedLinear]) -> PackedLinear:
    """Fused q/k/v or gate/up: the matrices stacked along the output (whole words of zero points each)."""
    parts = [p.untiled() for p in parts]  # stacked in rows (load time fuses before the GPU's tiling)
    first = parts[0]
    for p in parts[1:]:
        if (p.in_features, p.group_size, p.zero_offset) != (first.in_features, first.group_size, first.zero_offset):
            raise QuantError("matrices fused along the output must share input size, group size and format")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise QuantError("matrices fused along the output (q/k/v, gate/up) must share one g_idx order")
    for p in parts[:-1]:
        if p.out_features % 8:
            raise QuantError(f"a fused part of {p.out_features} outputs is not a whole number of zero-point words")
    return PackedLinear(torch.cat([p.qweight for p in parts]), torch.cat([p.qzeros for p in parts], dim=1),
                        torch.cat([p.scales for p in parts], dim=1), first.perm, first.group_size, first.zero_offset,
                        first.format)


class Rows:
    """Matrices stacked along the output that cannot be one PackedLinear: packed ones beside dense ones (a Gated
    DeltaNet layer's in_proj_qkv | z packed, its small in_proj_b | a dense), or packed parts whose output count is
    not a whole number of zero-point words. Each part is its own product; the outputs are concatenated."""

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        """Bytes held: each packed part's packed tensors, each dense part's values."""
        return sum(p.nbytes if isinstance(p, PackedLinear) else p.numel() * p.element_size() for p in self.parts)

    def packed_parts(self) -> list[PackedLinear]:
        return [p for p in self.parts if isinstance(p, PackedLinear)]

    def tiled(self, rows: int) -> Rows:
        """The packed parts' words held in tiles of ``rows`` rows where they can be (PackedLinear.tiled)."""
        return Rows([p.tiled(rows) if isinstance(p, PackedLinear) else p for p in self.parts])

    def dequantise(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantise(dtype) if isinstance(p, PackedLinear) else p.to(dtype) for p in self.parts])

    def _biases(self, b: torch.Tensor | None) -> list:
        return [None] * len(self.parts) if b is None else list(b.split([p.shape[0] for p in self.parts], -1))

    def linear(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ W^T + b, part by part (engine.kernels.decode.linear: the GEMV for a row on a GPU; a packed
        part's rows through PackedLinear.linear, so 2..16 rows on a GPU take the batched int4 GEMV)."""
        from engine.kernels import decode

        return torch.cat([decode.linear(x, p, pb) for p, pb in zip(self.parts, self._biases(b))], -1)

    def linear_norm(self, x: torch.Tensor, delta, norm_weight: torch.Tensor, eps: float, b=None, zc: bool = False):
        """engine.kernels.decode.linear_norm part by part: the first part's kernel adds delta, the others normalise its
        x + delta again (the norm prologue costs one read of the row)."""
        from engine.kernels import decode

        bs = self._biases(b)
        first, x_out = decode.linear_norm(x, delta, norm_weight, eps, self.parts[0], bs[0], zc=zc)
        zero = torch.zeros_like(x_out)
        rest = [decode.linear_norm(x_out, zero, norm_weight, eps, p, pb, zc=zc)[0]
                for p, pb in zip(self.parts[1:], bs[1:])]
        return torch.cat([first, *rest], -1), x_out


def _fusable(a: PackedLinear, b: PackedLinear) -> bool:
    """Whether b can follow a in one PackedLinear (cat's conditions)."""
    same_perm = a.perm is None and b.perm is None or (a.perm is not None and b.perm is not None
                                                       and torch.equal(a.perm, b.perm))
    return (a.out_features % 8 == 0 and same_perm
            and (a.in_features, a.group_size, a.zero_offset) == (b.in_features, b.group_size, b.zero_offset))


def stack(parts: list) -> PackedLinear | Rows:
    """Matrices (PackedLinear or dense [N, K] tensors) stacked along the output: runs of packed ones fused into
    one PackedLinear where ``cat`` can (each but the last a whole number of zero-point words), the rest a Rows."""
    runs: list = []
    for p in parts:
        last = runs[-1] if runs else None
        if isinstance(p, PackedLinear) and isinstance(last, list) and _fusable(last[-1], p):
            last.append(p)
        elif isinstance(p, PackedLinear):
            runs.append([p])
        elif isinstance(last, torch.Tensor):
            runs[-1] = torch.cat([last, p])
        else:
            runs.append(p)
    built = [cat(r) if isinstance(r, list) and len(r) > 1 else r[0] if isinstance(r, list) else r for r in runs]
    return built[0] if len(built) == 1 else Rows(built)


def from_checkpoint(q: QuantConfig, parts: dict[str, torch.Tensor], name: str, group_offset: int = 0) -> PackedLinear:
    """One module's tensors as stored (this rank's slice) -> PackedLinear on CPU. ``group_offset``: the first
    group this rank's rows belong to (row-parallel slices), subtracted from g_idx."""
    missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
    if missing:
        raise QuantError(f"{name}: quantised module without {', '.join(missing)}")
    qw, qz, sc = parts["qweight"], parts["qzeros"], parts["scales"]
    if qw.dtype != torch.int32 or qz.dtype != torch.int32:
        raise QuantError(f"{name}: qweight and qzeros must be int32, got {qw.dtype} and {qz.dtype}")
    if q.method == "gptq":
        k, n = qw.shape[0] * 8, qw.shape[1]
        held = qw.t().contiguous()  # [N, K / 8]
        zeros = qz
    else:
        k, n = qw.shape[0], qw.shape[1] * 8
        if k % 8:
            raise QuantError(f"{name}: {k} inputs are not a whole number of 8-value words")
        held = pack(awq_to_natural(qw).t().contiguous())  # [N, K] values -> [N, K / 8] words
        zeros = pack(awq_to_natural(qz))
    groups = 1 if q.group_size == -1 else k // q.group_size
    gs = k if q.group_size == -1 else q.group_size
    if tuple(sc.shape) != (groups, n) or tuple(zeros.shape) != (groups, n // 8):
        raise QuantError(f"{name}: scales {tuple(sc.shape)} / qzeros {tuple(qz.shape)} do not fit {k} inputs, {n} "
                         f"outputs in groups of {gs} (quantization_config.group_size = {q.group_size})")
    perm = None
    g_idx = parts.get("g_idx")
    if g_idx is not None:
        local = g_idx.to(torch.int64) - group_offset
        if tuple(local.shape) != (k,):
            raise QuantError(f"{name}: g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        if not torch.equal(local, torch.arange(k) // gs):
            if local.min() < 0 or local.max() >= groups:
                raise QuantError(f"{name}: g_idx (desc_act) refers to groups outside this rank's {groups}; a "
                                 f"desc_act checkpoint runs row-parallel modules only unsplit (tp 1)")
            if not torch.equal(torch.bincount(local, minlength=groups), torch.full((groups,), gs)):
                raise QuantError(f"{name}: g_idx gives groups of unequal size; expected {gs} inputs per group")
            perm = torch.argsort(local, stable=True)
            held = pack(unpack(held)[:, perm])
            perm = perm.to(torch.int32)
    return PackedLinear(held, zeros.contiguous(), sc.contiguous(), perm, q.group_size, q.zero_offset, q.format)


def is_packed(w: Any) -> bool:
    return isinstance(w, (PackedLinear, Rows))


def tiled(w: Any, rows: int) -> Any:
    """A packed matrix (PackedLinear, or a Rows' packed parts) with its words held in tiles of ``rows`` rows where
    they can be (PackedLinear.tiled); anything else as it is."""
    return w.tiled(rows) if isinstance(w, (PackedLinear, Rows)) else w


def matmul(x: torch.Tensor, w: torch.Tensor | PackedLinear | Rows, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense or packed weight: where the model's products dispatch."""
    return w.linear(x, b) if isinstance(w, (PackedLinear, Rows)) else F.linear(x, w, b)
