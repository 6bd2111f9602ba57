"""The decoder: Llama / Qwen2 / Qwen3 dense, the Qwen3.5 hybrid and Qwen3-Next (the hybrid with MoE MLPs), one code path for a whole model or one
tensor-parallel rank.

``Model.layers`` is a list of layer objects (engine.model.registry: the config's layer_types to their classes);
each is a mixer (attention or Gated DeltaNet) holding its MLP (``layer.mlp``), and each owns its weights, its
per-sequence state (a pool with a leading slot dimension), its prefill and its decode step. Every half-layer is
closed by an allreduce.

A rank holds ``1/world`` of the heads, of the MLP width and of the vocabulary;
the two points where partial results meet are the row-parallel outputs (o_proj,
down_proj: summed by ``comm.allreduce_sum``) and the vocabulary-split head
(``comm.gather_last``). With world = 1 there is no comm and no extra work.

Two forward paths share the weights:
  ``forward(tokens, pos0)``          prefill chunks: positions are Python ints.
  ``decode_step(tok, pos, window)``  THE decode step, one token with positions as device tensors and
                                     attention over a fixed cache window, so the whole step can be
                                     captured in a CUDA graph. Everything that decodes calls it (the
                                     runner, ranks, `generate`, the benches); engine/core/runner.py's Decoder
                                     replays it from graphs per context bucket.
  ``decode_batch(toks, pos, slots, window)``  B sequences, each in its state slot (setup_cache's ``slots``), one
                                     token each: rows forms of the kernels where they run, else torch forms;
                                     graphs per row bucket by engine/service/batch_graphs.py (docs/engine.md).
The kernel choice ("fused" or "eager", engine.core.decode_mode) is handed in: to decode_step by the runner's
Decoder, to the prefill as ``Model.kernels`` (set by the loader and the Decoder).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.core.config import ModelConfig
from engine.core.kvquant import KV_DTYPES
from engine.model.base import Chunk, Step, add_rms_norm, rms_norm, rope, rotate_half  # noqa: F401 (rope, rotate_half)
from engine.model.registry import make_layer


class Comm(Protocol):
    def allreduce_sum(self, x: torch.Tensor) -> torch.Tensor: ...
    def gather_last(self, x: torch.Tensor) -> torch.Tensor: ...


def inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], with the config's scaling (default, linear, llama3, yarn)."""
    dim = cfg.rotary_dim  # the whole head, or its first part (Qwen3.5's partial rotary factor)
    freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    sc = cfg.rope_scaling
    if not sc:
        return freq
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        return freq / float(sc["factor"])
    if kind == "llama3":
        factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old / lo, freq / factor, freq)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":  # YaRN (arXiv 2309.00071), as transformers computes it: a ramp between interpolation and
        # extrapolation over the dimensions whose wavelengths fall between beta_fast and beta_slow rotations
        factor = float(sc["factor"])
        base = cfg.rope_theta
        old = float(sc.get("original_max_position_embeddings") or cfg.max_position_embeddings)
        fast, slow = float(sc.get("beta_fast") or 32), float(sc.get("beta_slow") or 1)

        def correction(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction(fast), correction(slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor YaRN applies to cos and sin (1 for every other RoPE): 0.1 ln(factor) + 1, or the config's
    attention_factor, or the mscale / mscale_all_dim ratio where both are given (transformers' rule)."""
    sc = cfg.rope_scaling
    if not sc or sc.get("rope_type", sc.get("type")) != "yarn":
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    factor = float(sc["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if sc.get("mscale") and sc.get("mscale_all_dim"):
        return mscale(factor, float(sc["mscale"])) / mscale(factor, float(sc["mscale_all_dim"]))
    return mscale(factor)


class Model:
    def __init__(self, cfg: ModelConfig, *, world: int = 1, rank: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", comm: Comm | None = None, kv_dtype: str = "auto",
                 kernels: str | None = None):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv cache dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
        self.cfg, self.world, self.rank, self.dtype = cfg, world, rank, dtype
        self.kv_int8 = kv_dtype == "int8"
        self.device = torch.device(device)
        self.comm = comm
        self.zc = cfg.zero_centred_norm
        e = dict(dtype=dtype, device=self.device)
        self.embed = torch.empty(cfg.vocab_size, cfg.hidden_size, **e)  # replicated
        self.head = torch.empty(cfg.vocab_size // world, cfg.hidden_size, **e)  # this rank's vocabulary rows
        self.norm = torch.empty(cfg.hidden_size, **e)
        self.layers = [make_layer(cfg, world, dtype, self.device, kind, mlp)
                       for kind, mlp in zip(cfg.layer_types, cfg.mlp_types)]
        # engine.model.mtp.MTP: the checkpoint's draft layer(s), attached by the loader (engine.core.weights)
        self.mtp = None
        self.weights_origin = "checkpoint"  # or "random": generated at load (engine.core.random_weights)
        self.max_context = 0
        self.slots = 1  # sequence slots in every state pool (setup_cache)
        self.decoder = None  # engine.core.runner.Decoder, set by runner.prepare(): how decode_step is run
        # the prefill's kernel choice (engine.core.decode_mode.kernel_choice, handed in by the loader and the
        # Decoder): "fused" runs the Gated DeltaNet layers' chunked rule as engine.kernels.gdn_chunk's kernel;
        # None: the torch forms
        self.kernels = kernels
        self._inv_freq = inv_freq(cfg).to(self.device)
        # a prompt's embeddings (tokens [1, T], pos0) -> [1, T, D] while a prompt with images is prefilled
        # (engine.vision.prompt.Vision.embed: the image tokens' rows are the vision tower's); None = the table's rows
        self.embed_prompt = None

    @property
    def attention_layers(self) -> list:
        return [la for la in self.layers if la.kind == "full_attention"]

    # ---- cache and per-sequence state ------------------------------------------------------------
    def setup_cache(self, max_context: int, slots: int = 1) -> None:
        """Allocate the per-sequence state for positions [0, max_context) in ``slots`` sequence slots: the
        full-attention layers' K/V cache, the linear-attention layers' conv ring and recurrent state (fixed size),
        the MTP draft layers' K/V; and the RoPE tables. Slot 0 decodes until use_slot picks another."""
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        self.max_context, self.slots = max_context, slots
        for layer in self._all_layers():  # each pool's leading dimension: the sequence slot
            layer.alloc_state(slots, max_context, self.dtype, self.device, self.kv_int8)
            layer.slot = 0
        pos = torch.arange(max_context, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self._inv_freq[None, :]  # [S, rot / 2], float32 as Hugging Face does
        emb = torch.cat((freqs, freqs), dim=-1)  # [S, rot]
        af = rope_attention_factor(self.cfg)  # YaRN scales cos and sin (float32, then rounded, as transformers)
        self.cos = (emb.cos() * af).to(self.dtype)
        self.sin = (emb.sin() * af).to(self.dtype)

    def use_slot(self, slot: int) -> int:
        """Make ``slot`` the one that prefill (forward), decode_step and the MTP rounds read and write; returns
        the slot used before."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the {self.slots} allocated")
        before = self.layers[0].slot
        for layer in self._all_layers():
            layer.slot = slot
        return before

    def reset_slot(self, slot: int) -> None:
        """Zero one slot's state in every layer (a finished sequence frees it; the next starts from nothing)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is outside the {self.slots} allocated")
        for layer in self._all_layers():
            layer.reset_slot(slot)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of per-sequence state this rank holds: K/V (for the allocated context) and linear attention."""
        kv = sum(t.numel() * t.element_size() for la in self.attention_layers for t in la.state())
        lin = sum(t.numel() * t.element_size() for la in self.layers if la.kind == "linear_attention"
                  for t in la.state())
        return {"kv_cache": kv, "linear_state": lin}

    # ---- the two meeting points of tensor parallelism --------------------------------------------
    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.allreduce_sum(x)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.comm is None else self.comm.gather_last(x)

    # ---- prefill chunks and eager decode ----------------------------------------------------------
    def chunk_inputs(self, t: int, pos0: int):
        """(cos [T, rot], sin [T, rot]) of a chunk at positions pos0..pos0+T-1 (the causal rule with the cached
        prefix is engine.core.prefill_attention's: no mask is made)."""
        if pos0 + t > self.max_context:
            raise ValueError(f"positions up to {pos0 + t} exceed the allocated context {self.max_context}")
        return self.cos[pos0:pos0 + t], self.sin[pos0:pos0 + t]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, pos0: int, all_logits: bool = False, hidden: bool = False,
                states: list | None = None, slot: int | None = None):
        """tokens [1, T] at positions pos0..pos0+T-1 -> float32 logits [V] of the last position
        (or [T, V] with ``all_logits``). Writes the chunk's K/V (and linear-attention states) into the cache.
        ``hidden``: (logits, the final norm's output [T, D]: what an MTP draft layer reads); ``states``: a list
        that gets every linear-attention layer's states after each position (engine.model.gdn); ``slot``: the
        sequence slot written for this call (default: the one use_slot picked)."""
        if slot is not None:
            before = self.use_slot(slot)
            try:
                return self.forward(tokens, pos0, all_logits, hidden, states)
            finally:
                self.use_slot(before)
        cfg = self.cfg
        t = tokens.shape[1]
        cos, sin = self.chunk_inputs(t, pos0)
        chunk = Chunk(pos0, cos, sin, self.rank, self.kernels, states)
        x = F.embedding(tokens, self.embed) if self.embed_prompt is None else self.embed_prompt(tokens, pos0)
        x = self.layers_forward(x, lambda layer, h: layer.prefill(h, chunk))  # [1, T, D]
        x = rms_norm(x if all_logits or hidden else x[:, -1:], self.norm, cfg.rms_norm_eps, self.zc)
        logits = self._gather(F.linear(x if all_logits else x[:, -1:], self.head)).float()  # [1, T or 1, V]
        out = logits[0] if all_logits else logits[0, -1]
        return (out, x[0]) if hidden else out

    def layers_forward(self, x: torch.Tensor, mix) -> torch.Tensor:
        """x [1, T, D] through every layer: norm, ``mix(layer, h)`` (the mixer's partial output), allreduce, norm,
        MLP, allreduce; the final norm is the caller's (forward's; the speculative verification's)."""
        eps, zc = self.cfg.rms_norm_eps, self.zc
        for layer in self.layers:
            x = x + self._reduce(mix(layer, rms_norm(x, layer.input_norm, eps, zc)))
            x = x + self._reduce(layer.mlp.prefill(rms_norm(x, layer.mlp.post_norm, eps, zc), self.rank))
        return x

    # ---- THE decode step: one token with device-side positions (CUDA-graph capturable) -------------
    def decode_step(self, tok: torch.Tensor, pos: torch.Tensor, window: int, kernels: str | None = None,
                    exchange: str | None = None) -> torch.Tensor:
        """tok [1] and pos [1] (device int64) -> float32 logits [V]. The one decode step: the runner, the
        ranks, `generate` and the benches all call this (eagerly, or replayed from a CUDA graph by
        engine/core/runner.py's Decoder). Attention reads cache positions [0, window): no shape depends on pos,
        so one graph per window serves every position below it.

        A loop over the layers: each layer's mixer then its MLP, ``decode(x, delta, step, send)`` -> (x + delta,
        this rank's partial output), each followed by the allreduce. Each block starts with the residual add of
        the previous block's reduced output, so the add fuses with the norm in the fused path. ``kernels``: the
        decoder's choice ("fused": each kind's Triton path where its shapes fit; else the torch forms).
        ``exchange``: where the two ranks' partial outputs meet (engine.core.decode_mode.EXCHANGES: the runner's
        DecodeMode.exchange); None or "kernel" = the path's allreduce. Call it under torch.inference_mode()."""
        cfg = self.cfg
        x = F.embedding(tok.view(1, 1), self.embed)  # [1, 1, D]
        # additive mask, float32: 0 up to pos, -inf past it; made once per step for every layer
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        mask_bias = torch.where(torch.arange(window, device=self.device) <= pos, zero, float("-inf"))
        step = Step(pos, self.cos.index_select(0, pos), self.sin.index_select(0, pos),  # [1, rot]
                    mask_bias.view(1, 1, 1, window), window, self.rank, fused=kernels == "fused")
        delta = torch.zeros_like(x)
        xs = self.epilogue_exchange(kernels, exchange)  # "send": a small kernel receives what the GEMVs sent
        blocks = [b for layer in self.layers for b in (layer, layer.mlp)]
        for i, block in enumerate(blocks):
            send = None if xs is None else xs.ticket(i, cfg.hidden_size, self.dtype)
            x, part = block.decode(x, delta, step, send)
            # the last exchange is summed by xs.finish (it bumps the serial)
            delta = self._reduce(part) if xs is None else part if i + 1 == len(blocks) else xs.receive(part)
        if xs is not None:  # the final norm in the last exchange's kernel (rows of up to 8192: epilogue_exchange)
            x = xs.finish(delta, x, self.norm, cfg.rms_norm_eps, **({"zc": True} if self.zc else {}))
        else:
            x = rms_norm(x + delta, self.norm, cfg.rms_norm_eps, self.zc)
        return self._gather(F.linear(x, self.head)).float()[0, -1]  # [V]

    def prefill_slot(self, slot: int, ids: list[int], chunk: int = 2048) -> torch.Tensor:
        """A whole prompt from position 0 into ``slot`` in chunks of ``chunk`` tokens (the runner's chunked
        prefill, without prefix reuse) -> float32 logits [V] of its last position."""
        tokens = torch.tensor([ids], device=self.device)
        for pos0 in range(0, len(ids), chunk):
            logits = self.forward(tokens[:, pos0:pos0 + chunk], pos0, slot=slot)
        return logits

    @torch.inference_mode()
    def decode_batch(self, toks: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, window: int,
                     rope_pos: torch.Tensor | None = None) -> torch.Tensor:
        """B sequences one token each: toks [B], pos [B] and slots [B] (device int64, distinct slots) -> float32
        logits [B, V]; row b is what decode_step gives the sequence in slot slots[b] at pos[b] alone. ``rope_pos``
        [B]: the rows of the RoPE tables each token turns with where that is not its cache position (a prompt
        with images: pos + its multimodal delta, engine.vision.mrope; None: pos). One product over
        the B rows per linear layer (no exchange inside the GEMVs); where the kernels run, the residual adds and
        norms, the attention (each row over its own slot up to its position, window > every pos) and the Gated
        DeltaNet mix (each row's conv ring and recurrent state in its slot) are the one-sequence kernels' forms for
        rows, else torch forms that gather each row's window and state. No host sync: capturable
        (engine/service/batch_graphs.py replays it)."""
        cfg, b = self.cfg, toks.shape[0]
        x = F.embedding(toks.view(b, 1), self.embed)  # [B, 1, D]
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        mask_bias = torch.where(torch.arange(window, device=self.device)[None] <= pos[:, None], zero, float("-inf"))
        rp = pos if rope_pos is None else rope_pos
        step = Step(pos, self.cos.index_select(0, rp), self.sin.index_select(0, rp),  # [B, rot]
                    mask_bias.view(b, 1, 1, window), window, self.rank, slots=slots)
        delta = torch.zeros_like(x)
        for block in (bl for layer in self.layers for bl in (layer, layer.mlp)):
            x, part = block.decode(x, delta, step)
            delta = self._reduce(part)
        x = add_rms_norm(x, delta, self.norm, cfg.rms_norm_eps, self.zc, rows=True)[1]
        return self._gather(F.linear(x, self.head)).float()[:, -1]  # [B, V]

    def offers_exchange(self, kernels: str | None) -> bool:
        """Whether the TP2 exchange can run inside the GEMVs (engine.allreduce.epilogue): the fused kernels, a
        path that offers the exchange, every layer's fused path running here as kernels (the plain fallback adds
        the reduced delta itself, so it needs it materialised), no MoE (its routed experts take no ticket) and
        rows of up to 8192 values."""
        if self.comm is None or kernels != "fused" or self.cfg.moe:
            return False
        if getattr(getattr(self.comm, "path", None), "epilogue", None) is None:
            return False
        rot = self.cfg.rotary_dim
        return all(la.fused_here(self.device, rot) for la in self.layers) and self.cfg.hidden_size <= 8192

    def epilogue_exchange(self, kernels: str | None, exchange: str | None):
        """The path's exchange (engine.allreduce.epilogue.EpilogueExchange) when ``exchange`` (a DecodeMode's) sends
        from the GEMVs and the kernels take it (offers_exchange); else None: the path's allreduce."""
        if exchange in (None, "kernel") or not self.offers_exchange(kernels):
            return None
        return self.comm.path.epilogue()

    def weight_bytes(self) -> int:
        """Bytes this rank reads per decode step from weights (embedding: one row, not the table)."""
        n = self.head.numel() + self.norm.numel() + self.cfg.hidden_size
        for layer in self.layers:
            n += sum(t.numel() for t in layer.weights().values())
            mlp = layer.mlp
            if mlp.kind == "moe":  # a step reads the k chosen experts of E
                n -= (mlp.ew13.numel() + mlp.ew2.numel()) * (mlp.router.shape[0] - mlp.top_k) // mlp.router.shape[0]
        return n * self.head.element_size() + sum(p.nbytes for p in self.packed())

    def packed(self) -> list:
        """The packed (GPTQ / AWQ) matrices of this rank (engine.core.quant.PackedLinear, or a Rows: packed parts
        stacked with dense ones, counted whole)."""
        from engine.core.quant import is_packed

        return [w for layer in self._all_layers() for blk in (layer, layer.mlp) for w in blk.matrices().values()
                if is_packed(w)]

    def _all_layers(self) -> list:
        """The decoder's layers and the MTP draft layers (their weights are held too)."""
        return self.layers + (self.mtp.layers if self.mtp is not None else [])

    def weights_info(self) -> dict:
        """What `generate --json` and the rank's ready message report: the weight format and the bytes this rank
        holds for weights (every tensor but the per-sequence state; packed matrices as their packed tensors)."""
        q = self.cfg.quantization
        dense = [self.embed, self.head, self.norm] + [t for layer in self._all_layers() for t in layer.weights().values()]
        if self.mtp is not None:
            dense += [self.mtp.fc, self.mtp.emb_norm, self.mtp.hid_norm, self.mtp.norm]
        held = sum(t.numel() * t.element_size() for t in dense) + sum(p.nbytes for p in self.packed())
        fmt = str(self.dtype).removeprefix("torch.") if q is None else f"{q.format} ({str(self.dtype)[6:]} dense)"
        info = {"format": fmt, "bytes": held, "packed_matrices": len(self.packed())}
        if self.weights_origin != "checkpoint":
            info["origin"] = self.weights_origin  # random weights: the shape's speed and memory, not answers
        return info
