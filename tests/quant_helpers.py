"""GPTQ and AWQ checkpoints written by the tests themselves from a random transformers model.

Quantisation is plain round-to-nearest per group (what GPTQ's and AWQ's searches end with: a scale and a zero point
per group and output, 4-bit values), and the packing follows the writers' own code line for line, not the engine's:
  GPTQ  AutoGPTQ's QuantLinear.pack: qweight[row] |= intweight[j] << (4 * (j - i)) over the inputs [K / 8, N],
        zeros - 1 ("v1", checkpoint_format gptq) packed the same way over the outputs [G, N / 8], scales [G, N],
        g_idx [K] (desc_act: the group of each input in the order the quantiser walked them).
  AWQ   AutoAWQ's WQLinear_GEMM.from_linear: qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (4 * i) with
        order_map = [0, 2, 4, 6, 1, 3, 5, 7] over the outputs [K, N / 8]; zeros (not minus one) the same way.
The transformers model gets the dequantised weights w = s * (q - z) (fp16 scales), so it is the reference the engine
is judged against on exactly the weights the packed file holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.engine_helpers import small_config

QUANTISED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# wider than engine_helpers' models so group 128 divides every input, also each TP2 rank's half of o/down
WIDE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512)


def _group_index(k: int, group: int, order: torch.Tensor | None) -> torch.Tensor:
    gs = k if group == -1 else group
    if order is None:
        return torch.arange(k) // gs
    g = torch.empty(k, dtype=torch.long)
    g[order] = torch.arange(k) // gs  # the j-th input the quantiser walks is in group j // gs
    return g


def quantise(w: torch.Tensor, g_idx: torch.Tensor, sym: bool, min_zero: int):
    """Round-to-nearest 4-bit per (group, output): (q [N, K] int, zeros [G, N] int, scales [G, N] fp16)."""
    n, k = w.shape
    groups = int(g_idx.max()) + 1
    order = torch.argsort(g_idx, stable=True)  # each group's inputs together
    wg = w[:, order].double().view(n, groups, k // groups)  # [N, G, gs]
    if sym:
        s = (2 * wg.abs().amax(2) / 15).clamp_min(1e-8)
        z = torch.full((n, groups), 8, dtype=torch.int64)
    else:
        lo, hi = wg.amin(2).clamp(max=0), wg.amax(2).clamp(min=0)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = torch.round(-lo / s).long().clamp(min_zero, 15)
    s16 = s.half()
    qg = torch.clamp(torch.round(wg / s16.double()[:, :, None]) + z[:, :, None], 0, 15).long()
    q = torch.empty(n, k, dtype=torch.int64)
    q[:, order] = qg.view(n, k)
    return q, z.t().contiguous(), s16.t().contiguous()


def dequantise(q, zeros, scales, g_idx) -> torch.Tensor:
    return scales.float()[g_idx].t() * (q.float() - zeros.float()[g_idx].t())


def pack_gptq(q, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    intweight = q.t().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    z = (zeros.numpy() - 1).astype(np.uint32)  # v1: stored minus one
    qzeros = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= z[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return {"qweight": torch.from_numpy(qweight.view(np.int32)), "qzeros": torch.from_numpy(qzeros.view(np.int32)),
            "scales": scales, "g_idx": g_idx.to(torch.int32)}


AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def _pack_awq_cols(intweight: np.ndarray) -> np.ndarray:
    out = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            out[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]] << (i * 4)
    return out


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    qweight = _pack_awq_cols(q.t().numpy().astype(np.uint32))  # [K, N / 8]
    qzeros = _pack_awq_cols(zeros.numpy().astype(np.uint32))  # [G, N / 8]
    return {"qweight": torch.from_numpy(qweight.view(np.int32)), "qzeros": torch.from_numpy(qzeros.view(np.int32)),
            "scales": scales}


def make_quantised(name: str, out: Path, method: str, group: int, sym: bool = True, desc_act: bool = False,
                   dense: tuple[str, ...] = (), override: dict | None = None, seed: int = 1234):
    """A random transformers model of ``name``'s shrunk config, quantised and written to ``out`` as a GPTQ (v1) or
    AWQ (GEMM) checkpoint; returns the transformers model holding the dequantised weights. ``dense``: modules
    (e.g. "o_proj") left unquantised, as checkpoints mix them."""
    import transformers

    raw = small_config(name)
    raw.update(WIDE)
    raw.update(override or {})
    cfg = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    tensors = quantise_model(model, method, group, sym, desc_act, QUANTISED, dense, seed)
    write_checkpoint(out, model, tensors, raw, method, group, sym, desc_act)
    return model, tensors


def greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens (the reference the engine's tokens must equal)."""
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()


def quantise_model(model, method: str, group: int, sym: bool, desc_act: bool, quantised: tuple[str, ...],
                   dense: tuple[str, ...], seed: int) -> dict[str, torch.Tensor]:
    """Random weights into ``model``, its ``quantised`` modules (but ``dense``) rounded to 4 bits in place (the
    model holds the dequantised weights); returns the checkpoint's tensors, packed ones as the method stores them."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("A_log"):  # Gated DeltaNet decay rates and time steps as Qwen3.5 sets them up
                p.uniform_(0.0, 2.7, generator=gen)
            elif n.endswith("dt_bias"):
                p.uniform_(0.5, 1.5, generator=gen)
            elif "norm" in n:
                p.normal_(1.0, 0.1, generator=gen)
            elif "bias" in n:
                p.normal_(0.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.08, generator=gen)
        orders: dict[tuple[int, int], torch.Tensor] = {}  # one input order per (layer, input): q/k/v share theirs
        for n, p in model.named_parameters():
            mod = n.split(".")[-2]
            if not n.endswith(".weight") or mod not in quantised or mod in dense:
                tensors[n] = p.detach().clone().contiguous()
                continue
            k = p.shape[1]
            layer = int(n.split(".")[2])
            order = None
            if desc_act:
                key = (layer, {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 1, "up_proj": 1}.get(mod, hash(mod)))
                order = orders.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = _group_index(k, group, order)
            q, zeros, scales = quantise(p.detach(), g_idx, sym, min_zero=1 if method == "gptq" else 0)
            p.copy_(dequantise(q, zeros, scales, g_idx))
            base = n.removesuffix(".weight")
            packed = pack_gptq(q, zeros, scales, g_idx) if method == "gptq" else pack_awq(q, zeros, scales)
            tensors.update({f"{base}.{part}": t.contiguous() for part, t in packed.items()})
    return tensors


def write_checkpoint(out: Path, model, tensors: dict[str, torch.Tensor], raw: dict, method: str, group: int,
                     sym: bool, desc_act: bool) -> None:
    """model.safetensors and a config.json of ``raw`` with the method's quantization_config."""
    from safetensors.torch import save_file

    if not model.config.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = model.lm_head.weight.detach().clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    qc = ({"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": desc_act,
           "checkpoint_format": "gptq"} if method == "gptq" else
          {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))


def held_bytes(tensors: dict[str, torch.Tensor], desc_act: bool) -> int:
    """What a rank at TP1 holds: every tensor of the file, but g_idx only as one input order per stacked matrix
    when desc_act reorders the inputs (q/k/v share one, gate/up one), and not at all when it is k // group; a tied
    output head is a copy of the embedding."""
    n = sum(t.numel() * t.element_size() for name, t in tensors.items() if not name.endswith("g_idx"))
    if "lm_head.weight" not in tensors:
        n += tensors["model.embed_tokens.weight"].numel() * tensors["model.embed_tokens.weight"].element_size()
    if desc_act:
        for name, t in tensors.items():
            if name.endswith(("q_proj.g_idx", "o_proj.g_idx", "gate_proj.g_idx", "down_proj.g_idx")):
                n += t.numel() * 4
    return n


# the projections a 4-bit release of the hybrid packs (decoder and MTP draft layer alike)
HYBRID_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "out_proj")


def pack_checkpoint(src: Path, packed_dir: Path, dense_dir: Path | None, group: int) -> dict[str, torch.Tensor]:
    """A checkpoint directory's projections (HYBRID_PROJ) packed GPTQ v1 sym (group ``group``) into ``packed_dir``,
    and the same weights dequantised as a plain checkpoint into ``dense_dir`` (when given); every other file copied.
    Returns the packed file's tensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    packed, dense = {}, {}
    for name, t in tensors.items():
        if not name.endswith(".weight") or name.split(".")[-2] not in HYBRID_PROJ:
            packed[name] = dense[name] = t
            continue
        g_idx = _group_index(t.shape[1], group, None)
        q, zeros, scales = quantise(t.float(), g_idx, True, min_zero=1)
        dense[name] = dequantise(q, zeros, scales, g_idx).to(t.dtype).contiguous()
        base = name.removesuffix(".weight")
        packed.update({f"{base}.{part}": v.contiguous() for part, v in pack_gptq(q, zeros, scales, g_idx).items()})
    quant = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                     "desc_act": False, "checkpoint_format": "gptq"}}
    for d, held, extra in ((packed_dir, packed, quant), (dense_dir, dense, {})):
        if d is None:
            continue
        d.mkdir(parents=True, exist_ok=True)
        save_file(held, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**raw, **extra}))
        for f in src.iterdir():
            if f.name not in ("model.safetensors", "config.json") and f.is_file():
                (d / f.name).write_bytes(f.read_bytes())
    return packed
