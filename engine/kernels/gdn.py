"""The gated delta rule of Gated DeltaNet layers (Qwen3.5's linear attention), in torch: the reference forms.

Per value head, with a key head shared by ``Hv / Hk`` consecutive value heads, the float32 state S [dk, dv]
follows, for each token t (q and k L2-normalised over dk, q scaled by 1 / sqrt(dk)):

    S = S * exp(g_t)                       decay (g_t <= 0, per head)
    S = S + k_t (beta_t (v_t - S^T k_t))^T  the delta rule: write the part of v_t the state does not predict
    o_t = S^T q_t

Three forms of the same recurrence, as flash-linear-attention keeps them (``naive``, ``fused_recurrent``,
``chunk``): ``recurrent`` (token by token, the reference), ``chunked`` (prefill: chunks of 64 tokens through
the WY/UT form, a few matrix products per chunk and one sequential step per chunk), and ``step`` (decode: one
token, the state updated in place, no host sync: capturable in a CUDA graph). The state is passed in and out
explicitly. Everything is float32, whatever the model's dtype: the state is.

The causal depthwise conv in front of the rule keeps its last inputs in a ring of ``kernel`` slots per channel
(``conv_ring``): the input of position p sits in slot p % kernel, so one decode step writes its own slot and
reads the kernel - 1 before it without moving anything (and a kernel reading slots never races a writer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (flash-linear-attention's and Hugging Face's)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, ratio: int):
    """float32, key heads repeated onto value heads, q/k normalised, q scaled: [H, T, d] each; g, beta [H, T]."""
    q, k = q.float(), k.float()
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=1)
        k = k.repeat_interleave(ratio, dim=1)
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    return (q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1), g.float().transpose(0, 1),
            beta.float().transpose(0, 1))


def recurrent(q, k, v, g, beta, state):
    """The reference: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv], state [Hv, dk, dv] float32 ->
    (o [T, Hv, dv] float32, the final state). Token by token."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, v.shape[1] // k.shape[1])
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        kv = (s * k[:, t, :, None]).sum(-2)  # [H, dv]: what the state predicts for k_t
        s = s + k[:, t, :, None] * ((v[:, t] - kv) * beta[:, t, None])[:, None, :]
        out[:, t] = (s * q[:, t, :, None]).sum(-2)
    return out.transpose(0, 1), s


def chunk_parts(q, k, v, g, beta, chunk: int = 64, solve=None):
    """The chunked form's intra-chunk parts, batched over every chunk (the arguments of ``recurrent``; T padded to
    whole chunks of C): (u, w [H, N, C, dv | dk]: the UT transform's corrected values and keys; attn [H, N, C, C]:
    (q k^T) decay, causal; qd = q exp(cum), kd = k exp(cum_last - cum) [H, N, C, dk]; last = exp(cum_last) [H, N];
    T). ``solve``: A [.., C, C] -> (I + A)^-1, A's strictly lower part read (None: torch's triangular solve)."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, v.shape[1] // k.shape[1])
    h, t, dk = k.shape
    pad = -t % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    cum = g.cumsum(-1)  # [H, N, C]: log of the decay from the chunk's start to each token
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device)
    causal = tri.tril()  # i sees j <= i
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, N, C, C]
    kb = k * beta[..., None]
    # (I + A) u = beta v, (I + A) w = beta k exp(cum), A strictly lower: A_ij = beta_i k_i . k_j decay_ij (the
    # solve is unitriangular: it reads A's strictly lower part only and takes the diagonal as 1)
    a = (kb @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], kb * cum[..., None].exp()], -1)  # one solve for both
    if solve is None:
        uw = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    else:
        uw = solve(a) @ rhs  # the inverse of the unitriangular matrix, applied
    u, w = uw.split([v.shape[-1], dk], -1)
    attn = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], causal (decay is 0 above the diagonal)
    qd = q * cum[..., None].exp()
    kd = k * (cum[..., -1:] - cum).exp()[..., None]
    return u, w, attn, qd, kd, cum[..., -1].exp(), t


def chunked(q, k, v, g, beta, state, chunk: int = 64):
    """The chunked form for prefill; the arguments and results of ``recurrent``. Within a chunk of C tokens
    the C delta-rule updates are one lower-triangular solve (the UT transform, ``chunk_parts``); across chunks
    one state update each (here a Python loop; engine.kernels.gdn_chunk runs it as one Triton kernel)."""
    u, w, attn, qd, kd, last, t = chunk_parts(q, k, v, g, beta, chunk)
    h, n, _, dv = u.shape
    s = state.float().clone()
    out = torch.empty(h, n, chunk, dv, dtype=torch.float32, device=u.device)
    kdt = kd.transpose(-1, -2).contiguous()  # [H, N, dk, C]
    # one sequential step per chunk, three fused multiply-adds (few launches: on a GPU this loop is host-bound)
    for i in range(n):
        vn = torch.baddbmm(u[:, i], w[:, i], s, alpha=-1.0)  # the chunk's corrected values: u - w s
        torch.baddbmm(torch.bmm(attn[:, i], vn), qd[:, i], s, out=out[:, i])  # q s + (q k^T) vn
        s = torch.baddbmm(s * last[:, i, None, None], kdt[:, i], vn)
    out = out.reshape(h, n * chunk, dv)[:, :t]
    return out.transpose(0, 1), s


def step(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One decode token, in place: q, k [Hk, dk], v [Hv, dv], g, beta [Hv], state [Hv, dk, dv] float32 (updated)
    -> o [Hv, dv] float32. No Python value depends on the data (capturable)."""
    ratio = v.shape[0] // k.shape[0]
    q, k, v, g, beta = (x[None] for x in (q, k, v, g, beta))
    q, k, v, g, beta = _prep(q, k, v, g, beta, ratio)  # [H, 1, d], [H, 1]
    state.mul_(g.exp()[:, :, None])
    kv = (state * k.transpose(-1, -2)).sum(-2)  # [H, dv]
    state.add_(k.transpose(-1, -2) * ((v[:, 0] - kv) * beta)[:, None, :])
    return (state * q.transpose(-1, -2)).sum(-2)


def step_rows(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """``step`` for B sequences at once, one token each: q, k [B, Hk, dk], v [B, Hv, dv], g, beta [B, Hv], state
    [B, Hv, dk, dv] float32 (row b: sequence b's, updated in place) -> o [B, Hv, dv] float32; row b's arithmetic is
    step's on row b (the batched decode of several sequence slots)."""
    q, k, v, g, beta = _prep(q, k, v, g, beta, v.shape[1] // k.shape[1])  # [H, B, d], [H, B]
    q, k, v, g, beta = (x.transpose(0, 1) for x in (q, k, v, g, beta))  # [B, H, d], [B, H]
    state.mul_(g.exp()[:, :, None, None])
    kv = (state * k[..., None]).sum(-2)  # [B, H, dv]
    state.add_(k[..., None] * ((v - kv) * beta[..., None])[:, :, None, :])
    return (state * q[..., None]).sum(-2)


# ---- the causal depthwise conv and its ring of recent inputs ---------------------------------------------------

def conv_prefill(x: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, pos0: int) -> torch.Tensor:
    """x [T, C] (positions pos0..pos0+T-1) -> SiLU(causal depthwise conv) [T, C] in x's dtype; the ring
    [C, K] (slot p % K holds the input of position p) supplies the K - 1 inputs before pos0 (none at pos0 = 0)
    and gets the chunk's last inputs. weight [C, K]."""
    t, c = x.shape
    kk = weight.shape[1]
    if pos0 == 0:  # a new sequence: positions below 0 are the conv's zero padding, in the ring too
        ring.zero_()
    prev = ring[:, [p % kk for p in range(pos0 - kk + 1, pos0)]].t().to(x.dtype)  # [K - 1, C]
    full = torch.cat([prev, x], 0)  # [T + K - 1, C]
    out = F.conv1d(full.t()[None].to(weight.dtype), weight[:, None, :], groups=c)[0].t()  # [T, C]
    end = pos0 + t
    for p in range(max(pos0, end - kk), end):
        ring[:, p % kk] = x[p - pos0]
    return F.silu(out.to(x.dtype))


def conv_step(x: torch.Tensor, ring: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """One decode token: x [C] at position ``pos`` (device [1]) -> SiLU(conv) [C]; x written into its slot.
    Slots of positions below 0 hold zeros (prefill at position 0 writes them)."""
    kk = weight.shape[1]
    ring.index_copy_(1, torch.remainder(pos, kk), x.view(-1, 1).to(ring.dtype))
    idx = torch.remainder(pos - (kk - 1) + torch.arange(kk, device=pos.device), kk)  # oldest .. newest
    window = ring.index_select(1, idx)  # [C, K]
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out.to(x.dtype))


def conv_rows(x: torch.Tensor, rings: torch.Tensor, weight: torch.Tensor, pos: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
    """``conv_step`` for B sequences: x [B, C] at positions pos [B] of the sequences in ring pool rows ``slots``
    [B] (rings [slots, C, K]) -> SiLU(conv) [B, C]; each row's input written into its own ring."""
    kk = weight.shape[1]
    rings[slots, :, torch.remainder(pos, kk)] = x.to(rings.dtype)  # row b: ring slots[b], slot pos[b] % K
    idx = torch.remainder(pos[:, None] - (kk - 1) + torch.arange(kk, device=pos.device), kk)  # [B, K] oldest ..
    own = rings[slots]  # [B, C, K]
    window = own.gather(2, idx[:, None, :].expand(-1, own.shape[1], -1))
    out = (window.float() * weight.float()).sum(-1)
    return F.silu(out.to(x.dtype))
