"""Random-weight models: a model directory whose weights are generated on the card at load.

A directory with config.json and ``v100plan-random-weights.json`` (no safetensors) is a model of the config's
shape whose every tensor is drawn at load from one seeded generator on the rank's device, in a fixed order, in
full, then sliced for the rank as a checkpoint's tensor would be (engine.core.tp.take): so TP2 holds the halves
of the TP1 model and answers with its tokens. It exists for what only the shape decides: serving the 27B shape
at 256K positions on a card whose disk cannot hold a 54 GB checkpoint, memory, speed. /health and
``generate --json`` name the weights "random" so nothing is mistaken for a real model's answers.

``python -m engine make-random-model --config CONFIG DIR`` writes one (engine.core.random_cli). The values follow
the benches' random checkpoints (engine.bench.served.write_random_checkpoint uses ``value`` too).
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "v100plan-random-weights.json"
KIND = "v100plan_random_weights"
STD = 0.02


def is_random(model_dir: str | Path) -> bool:
    d = Path(model_dir)
    return (d / FILE).is_file() and not any(d.glob("*.safetensors"))


def read_spec(model_dir: str | Path) -> dict:
    spec = json.loads((Path(model_dir) / FILE).read_text())
    if spec.get("kind") != KIND or not isinstance(spec.get("seed"), int):
        raise ValueError(f"{Path(model_dir) / FILE}: not a random-weights file (kind {KIND}, an integer seed)")
    return spec


def hf_shapes(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Hugging Face Llama/Qwen (or Qwen3.5 / Qwen3-Next hybrid: Qwen3.5's projection names)
    checkpoint of this config, with its shape."""
    if cfg.hybrid:
        from engine.core.demo import hybrid_tensors

        return [(name, shape) for name, shape, _ in hybrid_tensors(cfg)]
    d, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    out = [("model.embed_tokens.weight", (cfg.vocab_size, d)), ("model.norm.weight", (d,))]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, d)))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (q, d)), (p + "self_attn.k_proj.weight", (kv, d)),
                (p + "self_attn.v_proj.weight", (kv, d)), (p + "self_attn.o_proj.weight", (d, q)),
                (p + "mlp.gate_proj.weight", (ff, d)), (p + "mlp.up_proj.weight", (ff, d)),
                (p + "mlp.down_proj.weight", (d, ff))]
        if cfg.attention_bias:
            out += [(p + f"self_attn.{n}_proj.bias", (s,)) for n, s in (("q", q), ("k", kv), ("v", kv))]
        if cfg.o_bias:
            out.append((p + "self_attn.o_proj.bias", (d,)))
        if cfg.qk_norm:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
    return out


def value(name: str, shape: tuple[int, ...], cfg, dtype, device, g):
    """The tensor ``name`` of a random model: matrices N(0, STD) from ``g`` (on ``device``), decay rates A in
    [1, 16) (log stored), dt_bias and the gated norm 1, other norms the unit (0 where zero-centred), biases 0."""
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(0.0, 2.77, generator=g).to(dtype)
    if name.endswith(("dt_bias", "linear_attn.norm.weight")):
        return torch.ones(shape, dtype=dtype, device=device)
    if len(shape) == 1:
        unit = 0.0 if cfg.zero_centred_norm or "norm" not in name else 1.0
        return torch.full(shape, unit, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, STD, generator=g)


def write(out_dir: str | Path, raw_config: dict, seed: int = 0) -> dict:
    """config.json + the random-weights file; the config is checked by engine.core.config first."""
    from engine.core import config as ecfg

    cfg = ecfg.from_dict(raw_config)
    if cfg.quantization is not None:
        raise ValueError("a random-weights model is dense: drop quantization_config from the config")
    d = Path(out_dir)
    if d.exists() and any(d.glob("*.safetensors")):
        raise ValueError(f"{d} holds safetensors files: a random-weights model must not sit beside a checkpoint")
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(raw_config, indent=1) + "\n")
    spec = {"kind": KIND, "seed": int(seed), "std": STD,
            "note": "weights are generated at load from this seed: for shape, memory and speed, not for answers"}
    (d / FILE).write_text(json.dumps(spec, indent=1) + "\n")
    params = sum(_numel(s) for _, s in hf_shapes(cfg))
    return {"dir": str(d), "parameters": params, "seed": int(seed), "layers": cfg.num_layers,
            "files": sorted(p.name for p in d.iterdir())}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def load(model, model_dir: str | Path, place) -> set[str]:
    """Fill ``model`` with the random model's tensors (this rank's slices); ``place(name, tensor)`` puts one
    where engine.core.weights would put the checkpoint's. Returns the names placed."""
    import torch

    from engine.core import tp

    spec = read_spec(model_dir)
    cfg = model.cfg
    g = torch.Generator(device=model.device).manual_seed(spec["seed"])
    names = set()
    for name, shape in hf_shapes(cfg):
        if name.startswith("mtp.") and model.mtp is None:
            continue
        full = value(name, shape, cfg, model.dtype, model.device, g)  # drawn in full on every rank: same stream
        canon = tp.canonical(name, cfg)
        place(canon, tp.take(full, tp.kind_of(canon), model.rank, model.world, cfg))
        names.add(canon)
        del full
    if cfg.tie_word_embeddings and "lm_head.weight" not in names:
        emb = value("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), cfg, model.dtype, model.device,
                    torch.Generator(device=model.device).manual_seed(spec["seed"]))
        place("lm_head.weight", tp.take(emb, "vocab", model.rank, model.world))
        names.add("lm_head.weight")
    return names
