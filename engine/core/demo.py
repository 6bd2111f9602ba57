"""The demo models, made locally, byte-identical everywhere: ``v100plan-demo`` (``--arch llama``, a small
Llama-layout model) and ``v100plan-demo-hybrid`` (``--arch qwen3_5``, the Qwen3.5 hybrid class the field
serves: three Gated DeltaNet layers then one gated full-attention layer, as the 27B model's every-4th pattern).

Weights come from numpy's PCG64 bit generator with a fixed seed, turned into
floats by plain integer arithmetic (raw 64-bit words -> 24-bit uniforms), and the
safetensors file is written here byte by byte: no library version can change a
byte of it. The tokenizer is a BPE over the ASCII vocabulary in
engine/data/demo_vocab.json, built with the tokenizers library.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from engine import DATA_DIR

MODEL_ID = "v100plan-demo"
SEED = 8  # chosen for the widest greedy top-1 margins over the test prompts (min 7.5e-3 on logits up to 13)
VOCAB_FILE = DATA_DIR / "demo_vocab.json"

# About 3.2 M parameters: two CPU ranks decode it in milliseconds per token.
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "torch_dtype": "float32",
    "v100plan": {"model_id": MODEL_ID, "seed": SEED, "add_bos_token": True},
}

HYBRID_ID = "v100plan-demo-hybrid"
HYBRID_SEED = 8
# About 2.2 M parameters; linear attention 2 key / 6 value heads (each key head serves 3, as in the 27B model),
# so TP2 gives each rank one key head and three value heads.
HYBRID_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 256,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "torch_dtype": "float32",
    "v100plan": {"model_id": HYBRID_ID, "seed": HYBRID_SEED, "add_bos_token": True},
}
ARCHS = {"llama": (CONFIG, MODEL_ID, SEED), "qwen3_5": (HYBRID_CONFIG, HYBRID_ID, HYBRID_SEED)}
# ``--mtp``: the hybrid with one MTP draft layer (mtp.*, as Qwen3.5 checkpoints carry it). Its tensors come after
# the decoder's in the PCG64 stream, so the decoder's weights are those of v100plan-demo-hybrid exactly.
MTP_ID = "v100plan-demo-hybrid-mtp"

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Uniform half-widths per tensor family. The head is wide on purpose: greedy top-1 margins must sit
# far above float32 rounding so that two half-width matrix products (TP2) choose the same tokens as one.
_SCALE = {"embed": 1.0, "attn": 0.11, "mlp": 0.11, "down": 0.062, "head": 0.35, "conv": 0.5, "norm": 0.1,
          "lin": 0.11}


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """CHAT_TEMPLATE without jinja2."""
    text = "".join(f"<|{m['role']}|>{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def hybrid_tensors(cfg) -> list[tuple[str, tuple[int, ...], str]]:
    """Every tensor of a Qwen3.5 (qwen3_5_text) checkpoint of this engine.core.config.ModelConfig: (name, shape,
    family); families: norm (zero-centred, 0 = unit), one, alog (log decay rates), conv, lin, attn, mlp, down,
    embed, head. The demo and the benches' random checkpoints both write these."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out = [("model.embed_tokens.weight", (v, d), "embed")]
    kinds = [(f"model.layers.{i}.", kind, mlp) for i, (kind, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_types))]
    out += _hybrid_layers(cfg, kinds)
    out += [("model.norm.weight", (d,), "norm")]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (v, d), "head"))
    if cfg.mtp_layers:  # the draft layer: fc over [embedding | hidden], its norms, full-attention layers
        out += [("mtp.fc.weight", (d, 2 * d), "attn"), ("mtp.pre_fc_norm_embedding.weight", (d,), "norm"),
                ("mtp.pre_fc_norm_hidden.weight", (d,), "norm")]
        out += _hybrid_layers(cfg, [(f"mtp.layers.{i}.", "full_attention", "dense") for i in range(cfg.mtp_layers)])
        out.append(("mtp.norm.weight", (d,), "norm"))
    return out


def _hybrid_layers(cfg, kinds: list[tuple[str, str, str]]) -> list[tuple[str, tuple[int, ...], str]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    nv, kd, vd = cfg.linear_num_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
    out = []
    for p, kind, mlp in kinds:
        out.append((p + "input_layernorm.weight", (d,), "norm"))  # zero-centred: applied as 1 + w
        if kind == "linear_attention":
            a = p + "linear_attn."
            out += [(a + "in_proj_qkv.weight", (2 * kd + vd, d), "lin"), (a + "in_proj_z.weight", (vd, d), "lin"),
                    (a + "in_proj_b.weight", (nv, d), "lin"), (a + "in_proj_a.weight", (nv, d), "lin"),
                    (a + "conv1d.weight", (2 * kd + vd, 1, cfg.linear_conv_kernel_dim), "conv"),
                    (a + "A_log", (nv,), "alog"), (a + "dt_bias", (nv,), "one"),
                    (a + "norm.weight", (cfg.linear_value_head_dim,), "one"),
                    (a + "out_proj.weight", (d, vd), "attn")]
        else:
            a = p + "self_attn."
            out += [(a + "q_proj.weight", (2 * nh * hd, d), "attn"), (a + "k_proj.weight", (nkv * hd, d), "attn"),
                    (a + "v_proj.weight", (nkv * hd, d), "attn"), (a + "o_proj.weight", (d, nh * hd), "attn"),
                    (a + "q_norm.weight", (hd,), "norm"), (a + "k_norm.weight", (hd,), "norm")]
        out.append((p + "post_attention_layernorm.weight", (d,), "norm"))
        out += _moe_mlp(cfg, p) if mlp == "moe" else [
            (p + "mlp.gate_proj.weight", (f, d), "mlp"), (p + "mlp.up_proj.weight", (f, d), "mlp"),
            (p + "mlp.down_proj.weight", (d, f), "down")]
    return out


def _moe_mlp(cfg, p: str) -> list[tuple[str, tuple[int, ...], str]]:
    """A Qwen3-Next MoE MLP's tensors as its checkpoints hold them: router, every expert, the shared expert."""
    d, fe, fs = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = [(p + "mlp.gate.weight", (cfg.num_experts, d), "lin")]
    for e in range(cfg.num_experts):
        q = f"{p}mlp.experts.{e}."
        out += [(q + "gate_proj.weight", (fe, d), "mlp"), (q + "up_proj.weight", (fe, d), "mlp"),
                (q + "down_proj.weight", (d, fe), "down")]
    q = p + "mlp.shared_expert."
    return out + [(q + "gate_proj.weight", (fs, d), "mlp"), (q + "up_proj.weight", (fs, d), "mlp"),
                  (q + "down_proj.weight", (d, fs), "down"), (p + "mlp.shared_expert_gate.weight", (1, d), "lin")]


def _tensor_names(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    # (the multimodal wrapper's names are engine.vision.demo's, which hands them to weights_bytes)
    if cfg["model_type"] == "qwen3_5_text":
        from engine.core import config as ecfg

        return hybrid_tensors(ecfg.from_dict(cfg))
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    out = [("model.embed_tokens.weight", (v, d), "embed")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,), "one"),
                (p + "self_attn.q_proj.weight", (q, d), "attn"),
                (p + "self_attn.k_proj.weight", (kv, d), "attn"),
                (p + "self_attn.v_proj.weight", (kv, d), "attn"),
                (p + "self_attn.o_proj.weight", (d, q), "attn"),
                (p + "post_attention_layernorm.weight", (d,), "one"),
                (p + "mlp.gate_proj.weight", (f, d), "mlp"),
                (p + "mlp.up_proj.weight", (f, d), "mlp"),
                (p + "mlp.down_proj.weight", (d, f), "down")]
    out += [("model.norm.weight", (d,), "one"), ("lm_head.weight", (v, d), "head")]
    return out


def weights_bytes(seed: int = SEED, cfg: dict | None = None,
                  names: list | None = None) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """name -> (shape, little-endian float32 bytes), from one PCG64 stream in a fixed tensor order."""
    import numpy as np

    bits = np.random.PCG64(seed)
    out = {}
    for name, shape, family in names or _tensor_names(cfg or CONFIG):
        n = int(np.prod(shape))
        if family == "one":
            arr = np.ones(n, dtype="<f4")
        else:
            raw = bits.random_raw(n).astype(np.uint64)
            # Top 24 bits -> uniform in [0, 1) exactly representable in float32, then [-s, s).
            u = (raw >> np.uint64(40)).astype(np.float64) / float(1 << 24)
            if family == "alog":  # log of decay rates A in [1, 16), as Qwen3.5 initialises them
                arr = (u * 2.77).astype("<f4")
            else:
                arr = ((u * 2.0 - 1.0) * _SCALE[family]).astype("<f4")
        out[name] = (shape, arr.tobytes())
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], bytes]], metadata: dict[str, str]) -> None:
    """The safetensors format by hand: u64 header length, JSON header (8-byte aligned), raw data."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        shape, data = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    hb = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)))
        fh.write(hb)
        for name in sorted(tensors):
            fh.write(tensors[name][1])


def build_tokenizer():
    """A BPE over the shipped ASCII vocabulary: characters, then two-character merges in file order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    spec = json.loads(VOCAB_FILE.read_text())
    tokens = spec["special"] + spec["chars"] + spec["pairs"]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [(p[0], p[1]) for p in spec["pairs"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=False))
    tok.decoder = decoders.Fuse()  # pieces are literal text: concatenate, no separator
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    return tok


def make(out_dir: str | Path, seed: int | None = None, arch: str = "llama", mtp: bool = False) -> dict:
    """Write the demo model of ``arch`` (ARCHS) into ``out_dir``; returns a summary (files, parameter count).
    ``mtp``: the qwen3_5 demo with one MTP draft layer (MTP_ID)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown demo architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    base, model_id, default_seed = ARCHS[arch]
    if mtp:
        if arch != "qwen3_5":
            raise ValueError("--mtp needs --arch qwen3_5: the MTP draft layer is Qwen3.5's")
        base, model_id = dict(base, mtp_num_hidden_layers=1, v100plan=dict(base["v100plan"], model_id=MTP_ID)), MTP_ID
    seed = default_seed if seed is None else seed
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(base)
    cfg["v100plan"] = dict(base["v100plan"], seed=seed)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = weights_bytes(seed, base)
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt", "model_id": model_id, "seed": str(seed)})
    build_tokenizer().save(str(d / "tokenizer.json"))
    spec = json.loads(VOCAB_FILE.read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": CONFIG["max_position_embeddings"],
        "additional_special_tokens": spec["special"][4:],
    }, indent=2, sort_keys=True) + "\n")
    params = sum(len(b) // 4 for _, b in tensors.values())
    return {"model_id": model_id, "arch": arch, "dir": str(d), "parameters": params, "seed": seed,
            "files": sorted(p.name for p in d.iterdir())}
