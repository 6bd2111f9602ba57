"""The MTP draft layer as Qwen3.5 / Qwen3-Next checkpoints carry it (``mtp.*``, config ``mtp_num_hidden_layers``;
vLLM's qwen3_next_mtp.py reads it the same way): at position p it takes the embedding of token p + 1 and the
model's hidden state at p (the output of the final norm, what the head reads) and predicts token p + 2:

    x = fc(cat(norm_e(embed(token[p + 1])), norm_h(hidden[p])))     fc [D, 2D], zero-centred norms
    x = one gated full-attention decoder layer (its own K/V cache pool, MLP)
    hidden' = norm(x); logits = the model's head(hidden')            the embedding and head are the model's

Under TP2 fc is replicated and the layer splits as the decoder's (heads, MLP columns; two allreduces). The loader
(engine.core.weights) attaches it to a model whose config declares it; engine.core.mtp runs the rounds."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from engine.core.config import ModelConfig
from engine.model.base import Chunk, rms_norm
from engine.model.registry import make_layer


class MTP:
    """The draft layer's weights for this rank (fc and the three norms replicated, its layers split)."""

    def __init__(self, cfg: ModelConfig, world: int, dtype: torch.dtype, device: torch.device):
        e = dict(dtype=dtype, device=device)
        d = cfg.hidden_size
        self.fc = torch.empty(d, 2 * d, **e)  # columns: [embedding | hidden]
        self.emb_norm = torch.empty(d, **e)  # pre_fc_norm_embedding
        self.hid_norm = torch.empty(d, **e)  # pre_fc_norm_hidden
        self.norm = torch.empty(d, **e)
        self.layers = [make_layer(cfg, world, dtype, device, "full_attention") for _ in range(cfg.mtp_layers)]

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        out = [("fc", self.fc), ("emb_norm", self.emb_norm), ("hid_norm", self.hid_norm), ("norm", self.norm)]
        for i, layer in enumerate(self.layers):
            out += [(f"layers.{i}.{k}", t) for k, t in layer.weights().items()]
        return out

    @torch.inference_mode()
    def forward(self, model, tokens: list[int], hidden: torch.Tensor, pos0: int,
                step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens[i] (the token at position pos0 + i + 1) and hidden [T, D] (the model's at pos0 + i) ->
        (hidden' [T, D], float32 logits [T, V]: the token at pos0 + i + 2). Writes its K/V at pos0.. .
        ``step``: which draft step (several MTP layers take turns, as vLLM runs them)."""
        cos, sin = model.chunk_inputs(len(tokens), pos0)
        chunk = Chunk(pos0, cos, sin, model.rank)
        return self.run(model, torch.tensor(tokens, device=model.device), hidden, step,
                        lambda layer, h: layer.prefill(h, chunk))

    def run(self, model, tokens: torch.Tensor, hidden: torch.Tensor, step: int, attend: Callable,
            norm: Callable = rms_norm) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's arithmetic with tokens [T] on the device; ``attend(layer, h [1, T, D])`` -> the o_proj partial
        (the prefill attention, or engine.core.spec_graphs' one with device positions); ``norm``: rms_norm or its
        one-kernel form (engine.kernels.rows_norm.norm)."""
        eps, zc = model.cfg.rms_norm_eps, model.zc
        e = F.embedding(tokens, model.embed)  # [T, D]
        x = F.linear(torch.cat([norm(e, self.emb_norm, eps, zc), norm(hidden, self.hid_norm, eps, zc)], -1),
                     self.fc)[None]  # [1, T, D]
        layer = self.layers[step % len(self.layers)]
        h = norm(x, layer.input_norm, eps, zc)
        x = x + model._reduce(attend(layer, h))
        h = norm(x, layer.mlp.post_norm, eps, zc)
        x = x + model._reduce(layer.mlp.prefill(h, model.rank))
        x = norm(x, self.norm, eps, zc)
        return x[0], model._gather(F.linear(x, model.head)).float()[0]
