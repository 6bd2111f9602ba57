"""MTP speculation's captured steps: the verification of K + 1 positions and the draft layer's K drafts, each one
CUDA graph per context bucket, over static buffers (engine.core.mtp runs the eager forms on CPU).

A round on graphs (greedy):
  draft graph (rows r = accepted drafts + 1, window w)  the draft layer catches up on the r positions the last
      round accepted (their tokens and the verification's hidden states, all on the device already), then K - 1
      one-row steps, each drafting the argmax of the one before: the K drafts land in ``tok[1:]``.
  verify graph (K, w)  the model over [t, d1..dK] at pos..pos+K in one forward with device positions: full
      attention reads cache positions [0, w) under a per-row causal mask (row i sees positions <= pos + i, so K/V
      a rejected draft wrote past the accepted one is never read and is overwritten by the next round); each
      linear-attention layer's conv ring and recurrent state after every position go into static buffers
      ``rings[i]`` / ``recs[i]``; the argmax of every row into ``argmax``.
  one read-back (``tok`` and ``argmax``: 2 (K + 1) integers) -> the accepted count a on the host;
  rollback graph a (a < K)  every linear-attention layer's ring and state := rings[a] / recs[a]: device copies
      (two multi-tensor kernels for all layers; no host copy of any state), one graph per a.
Sampled rounds draft eagerly (the rejection rule draws on the host) and verify through the same graph.

The row functions below are the graphs' bodies; on CPU they run eagerly (tests compare them with the eager
verification, Model.forward with ``states``).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from engine.core.quant import matmul
from engine.model.base import rms_norm


def kernels_here(model) -> bool:
    """Whether the verification runs Triton kernels (engine.kernels.rows_norm, engine.kernels.decode's Gated DeltaNet kernel): where the
    decoder's blocks do (its kernel choice is not "eager": Triton present, a card it targets, not asked off), and
    on CPU tensors under Triton's interpreter (the tests)."""
    from engine.kernels import decode

    if not decode.runs_here(model.device):
        return False
    dec = getattr(model, "decoder", None)
    return model.device.type != "cuda" or dec is None or dec.kernels != "eager"


def _norm(model):
    from engine.kernels import rows_norm

    return rows_norm.norm if kernels_here(model) else rms_norm


def row_inputs(model, pos: torch.Tensor, t: int, window: int):
    """(positions [T], cos [T, rot], sin [T, rot], additive float32 mask [T, W]) of T rows from device ``pos``."""
    pp = pos + torch.arange(t, device=pos.device)  # [T]
    keys = torch.arange(window, device=pos.device)
    zero = torch.zeros((), dtype=torch.float32, device=pos.device)
    bias = torch.where(keys[None, :] <= pp[:, None], zero, float("-inf"))  # row i sees positions <= pos + i
    return pp, model.cos.index_select(0, pp), model.sin.index_select(0, pp), bias


def attend_rows(model, layer, h: torch.Tensor, cos, sin, pp: torch.Tensor, bias: torch.Tensor,
                window: int) -> torch.Tensor:
    """A full-attention layer over T rows at device positions ``pp``: h [1, T, D] -> o_proj partial [1, T, D]; the
    rows' K/V written at pp, attention over cache positions [0, window) under ``bias`` [T, W]."""
    t = h.shape[1]
    q, k, v, gate = layer.qkv(h, cos, sin, model.cfg.rms_norm_eps, _norm(model))  # q [1, h, T, hd], k / v [1, kv, T, hd]
    if layer.k_scale is None:
        layer.k_cache.index_copy_(2, pp, k)
        layer.v_cache.index_copy_(2, pp, v)
        keys, values = layer.k_cache[:, :, :window], layer.v_cache[:, :, :window]  # [1, kv, W, hd]
    else:
        from engine.core import kvquant

        kvquant.write(layer.k_cache, layer.k_scale, k, pos=pp)
        kvquant.write(layer.v_cache, layer.v_scale, v, pos=pp)
        keys = kvquant.dequantize(layer.k_cache[:, :, :window], layer.k_scale[:, :, :window], q.dtype)
        values = kvquant.dequantize(layer.v_cache[:, :, :window], layer.v_scale[:, :, :window], q.dtype)
    g, hd = layer.n_heads // layer.n_kv, layer.hd
    qg = q.reshape(1, layer.n_kv, g * t, hd)  # the g query heads of a kv head, T rows each: no K/V copies
    s = torch.matmul(qg, keys.transpose(-1, -2)).float() * hd ** -0.5  # [1, kv, g T, W]
    p = torch.softmax(s.view(1, layer.n_kv, g, t, window) + bias, dim=-1).to(values.dtype)
    a = torch.matmul(p.view(1, layer.n_kv, g * t, window), values)  # [1, kv, g T, hd]
    a = a.view(1, layer.n_heads, t, hd).transpose(1, 2).reshape(1, t, layer.n_heads * hd)
    if gate is not None:
        a = a * torch.sigmoid(gate)
    return matmul(a, layer.wo, layer.bias_once(layer.bo, model.rank))


def gdn_rows(model, layer, h: torch.Tensor, pp: torch.Tensor, rings: torch.Tensor,
             recs: torch.Tensor) -> torch.Tensor:
    """A Gated DeltaNet layer over T rows: h [1, T, D] -> out_proj partial [1, T, D]. The four projections of all
    rows in one product (the weights read once), then position by position the decode step's conv and delta rule
    (engine.kernels.decode.gdn_decode's kernel on a GPU), the ring and state after row i copied into rings[i] [C, K] and
    recs[i] [nv, dk, dv]."""
    t = h.shape[1]
    proj = matmul(h[0], layer.w_in)  # [T, conv channels + vd + 2 nv]
    fused = kernels_here(model) and layer.fused_here(model.device, 0)
    ys = []
    for i in range(t):
        ys.append(layer.mix(proj[i], pp[i:i + 1], fused))
        rings[i].copy_(layer.conv_ring)
        recs[i].copy_(layer.rec_state)
    return matmul(torch.stack(ys).view(1, t, -1), layer.w_out)


def add_norm(model, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight): one kernel for all rows where the kernels run
    (engine.kernels.rows_norm), else the torch form (model.rms_norm's rounding either way)."""
    from engine.kernels import rows_norm

    eps, zc = model.cfg.rms_norm_eps, model.zc
    if kernels_here(model):
        return rows_norm.add_norm(x, delta, weight, eps, zc)
    x = x + delta
    return x, rms_norm(x, weight, eps, zc)


def rows_forward(model, x: torch.Tensor, mix) -> torch.Tensor:
    """Model.layers_forward and the final norm for T rows, each residual add fused with the norm after it."""
    delta = torch.zeros_like(x)
    for layer in model.layers:
        x, h = add_norm(model, x, delta, layer.input_norm)
        delta = model._reduce(mix(layer, h))
        x, h = add_norm(model, x, delta, layer.mlp.post_norm)
        delta = model._reduce(layer.mlp.prefill(h, model.rank))
    return add_norm(model, x, delta, model.norm)[1]


def verify_rows(model, tok: torch.Tensor, pos: torch.Tensor, window: int, rings: list, recs: list):
    """The model over tok [T] at positions pos.. (device [1]) -> (float32 logits [T, V], final-norm hidden [T, D]);
    K/V written, the linear-attention layers' per-row states into rings[j] / recs[j] (j: their order)."""
    t = tok.shape[0]
    pp, cos, sin, bias = row_inputs(model, pos, t, window)
    slot = {id(la): j for j, la in enumerate(la for la in model.layers if la.kind == "linear_attention")}

    def mix(layer, h):
        if layer.kind == "full_attention":
            return attend_rows(model, layer, h, cos, sin, pp, bias, window)
        j = slot[id(layer)]
        return gdn_rows(model, layer, h, pp, rings[j], recs[j])

    x = rows_forward(model, F.embedding(tok.view(1, t), model.embed), mix)
    return model._gather(F.linear(x, model.head)).float()[0], x[0]


def draft_rows(model, tok: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, window: int, step: int = 0):
    """MTP.forward with tokens tok [T] on the device and positions pos.. (device [1])."""
    pp, cos, sin, bias = row_inputs(model, pos, tok.shape[0], window)
    return model.mtp.run(model, tok, hidden, step, lambda layer, h: attend_rows(model, layer, h, cos, sin, pp, bias,
                                                                                window), _norm(model))


class SpecGraphs:
    """The captured round of K drafts (module docstring). Static buffers: ``tok`` [K + 1] (the round's first
    token, then the drafts), ``pos`` [1] (its position), ``hid`` [K + 1, D] (the verification's hidden states:
    the next draft's inputs), ``argmax`` [K + 1], per linear-attention layer ``rings`` [K + 1, C, K_conv] and
    ``recs`` [K + 1, nv, dk, dv]."""

    def __init__(self, model, k: int, windows: list[int]):
        self.model, self.k, self.windows = model, k, windows
        dev, lin = model.device, [la for la in model.layers if la.kind == "linear_attention"]
        self.tok = torch.zeros(k + 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.hid = torch.zeros(k + 1, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.argmax = torch.zeros(k + 1, dtype=torch.long, device=dev)
        self.rings = [torch.zeros(k + 1, *la.conv_ring.shape, dtype=la.conv_ring.dtype, device=dev) for la in lin]
        self.recs = [torch.zeros(k + 1, *la.rec_state.shape, dtype=torch.float32, device=dev) for la in lin]
        self.lin = lin
        self.out = torch.zeros(2 * (k + 1), dtype=torch.long, device=dev)  # [tok | argmax]: the one read-back
        self._verify: dict[tuple[int, int], tuple] = {}  # (drafts, window) -> (graph, logits [kk + 1, V])
        self._draft: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (rows, window) -> graph
        self._rollback: dict[int, torch.cuda.CUDAGraph] = {}  # accepted drafts a < K -> graph
        self.info = {"draft_tokens": k, "graphs": 0, "capture_s": None}

    # ---- the bodies --------------------------------------------------------------------------------
    def verify(self, kk: int, window: int) -> torch.Tensor:
        """The verification of tok[:kk + 1] at pos (a graph's body; eager on CPU) -> logits [kk + 1, V]."""
        logits, hid = verify_rows(self.model, self.tok[:kk + 1], self.pos, window, self.rings, self.recs)
        self.hid[:kk + 1].copy_(hid)
        self.argmax[:kk + 1].copy_(torch.argmax(logits, dim=-1))
        self.out.copy_(torch.cat([self.tok, self.argmax]))
        return logits

    def draft(self, rows: int, window: int) -> None:
        """Greedy drafts (a graph's body): the draft layer over the ``rows`` positions pos.. of the last round (the
        accepted drafts tok[1:rows] and the model's next token argmax[rows - 1], with hid[:rows]), then K - 1
        one-row steps; the round moves on: tok = [that next token, d1..dK], pos += rows."""
        nxt = self.argmax[rows - 1:rows]
        hs, logits = draft_rows(self.model, torch.cat([self.tok[1:rows], nxt]), self.hid[:rows], self.pos, window)
        start = self.pos + rows  # the new round's first position
        self.tok[:1].copy_(nxt)
        for j in range(1, self.k + 1):
            self.tok[j:j + 1].copy_(torch.argmax(logits[-1]).view(1))
            if j < self.k:
                hs, logits = draft_rows(self.model, self.tok[j:j + 1], hs[-1:], start + j - 1, window, step=j)
        self.pos.copy_(start)

    def rollback(self, a: int) -> None:
        """Every linear-attention layer's ring and state as after row ``a`` (a graph's body per a)."""
        if self.lin:
            torch._foreach_copy_([la.rec_state for la in self.lin], [recs[a] for recs in self.recs])
            torch._foreach_copy_([la.conv_ring for la in self.lin], [rings[a] for rings in self.rings])

    # ---- capture and replay ------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, pool=None, warm=None):
        """One graph per (drafts 0..K, window) for the verification, per (rows 1..K + 1, window) for the greedy
        drafts, per accepted count 0..K - 1 for the rollback. Warm-up runs write K/V and states at positions 0..2K, which every request's
        prefill writes again before reading. ``warm(fn)``: runs fn's warm-ups on a side stream."""
        t0 = time.perf_counter()
        bodies = [(("v", kk, w), lambda kk=kk, w=w: self.verify(kk, w)) for w in self.windows
                  for kk in range(self.k + 1)]
        bodies += [(("d", r, w), lambda r=r, w=w: self.draft(r, w)) for w in self.windows
                   for r in range(1, self.k + 2)]
        bodies += [(("r", a), lambda a=a: self.rollback(a)) for a in range(self.k)]
        for key, body in bodies:
            self.pos.zero_()
            side = torch.cuda.Stream(self.model.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.pos.zero_()
                    body()
            torch.cuda.current_stream().wait_stream(side)
            self.pos.zero_()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                res = body()
            pool = g.pool()
            if key[0] == "v":
                self._verify[key[1:]] = (g, res)
            elif key[0] == "d":
                self._draft[key[1:]] = g
            else:
                self._rollback[key[1]] = g
        torch.cuda.synchronize(self.model.device)
        self.info.update(graphs=len(bodies), capture_s=round(time.perf_counter() - t0, 2))
        return pool

    def replay_draft(self, rows: int, window: int) -> None:
        self._draft[(rows, window)].replay()

    def replay_verify(self, kk: int, window: int) -> torch.Tensor:
        g, logits = self._verify[(kk, window)]
        g.replay()
        return logits

    def replay_rollback(self, a: int) -> None:
        self._rollback[a].replay()
