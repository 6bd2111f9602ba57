"""The demo model ``v100plan-demo``: a small Llama-layout model made locally, byte-identical everywhere.

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

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

# Uniform half-widths per tensor family. The head is wide on purpose: greedy top-1 margins must sit
# far above float32 rounding so that two half-width matrix products (TP2) choose the same tokens as one.
_SCALE = {"embed": 1.0, "attn": 0.11, "mlp": 0.11, "down": 0.062, "head": 0.35}


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """CHAT_TEMPLATE without jinja2."""
    text = "".join(f"<|{m['role']}|>{m['content']}<|end|>\n" for m in messages)
    return text + ("<|assistant|>" if add_generation_prompt else "")


def _tensor_names(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
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


def weights_bytes(seed: int = SEED) -> dict[str, tuple[tuple[int, ...], bytes]]:
    """name -> (shape, little-endian float32 bytes), from one PCG64 stream in a fixed tensor order."""
    import numpy as np

    bits = np.random.PCG64(seed)
    out = {}
    for name, shape, family in _tensor_names(CONFIG):
        n = int(np.prod(shape))
        if family == "one":
            arr = np.ones(n, dtype="<f4")
        else:
            raw = bits.random_raw(n).astype(np.uint64)
            # Top 24 bits -> uniform in [0, 1) exactly representable in float32, then [-s, s).
            u = (raw >> np.uint64(40)).astype(np.float64) / float(1 << 24)
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


def make(out_dir: str | Path, seed: int = SEED) -> dict:
    """Write the demo model into ``out_dir``; returns a summary (files, parameter count)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg = dict(CONFIG)
    cfg["v100plan"] = dict(CONFIG["v100plan"], seed=seed)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = weights_bytes(seed)
    write_safetensors(d / "model.safetensors", tensors, {"format": "pt", "model_id": MODEL_ID, "seed": str(seed)})
    build_tokenizer().save(str(d / "tokenizer.json"))
    spec = json.loads(VOCAB_FILE.read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": CONFIG["max_position_embeddings"],
        "additional_special_tokens": spec["special"][4:],
    }, indent=2, sort_keys=True) + "\n")
    params = sum(len(b) // 4 for _, b in tensors.values())
    return {"model_id": MODEL_ID, "dir": str(d), "parameters": params, "seed": seed,
            "files": sorted(p.name for p in d.iterdir())}
