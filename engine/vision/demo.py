"""``make-demo-model --arch qwen3_5 --vision``: v100plan-demo-vision, the hybrid demo as a Qwen3.5 multimodal
checkpoint (transformers' Qwen3_5ForConditionalGeneration layout): config.json with text_config and
vision_config, the decoder under ``model.language_model.``, a two-block vision tower under ``model.visual.``,
four more special tokens (vision start / end, image pad, video pad), a chat template that puts
``<|vision_start|><|image_pad|><|vision_end|>`` where a message has an image part, and a
preprocessor_config.json (16-pixel patches merged 2 x 2; 64 x 64 to 256 x 256 pixels: 4 to 64 image tokens).

Weights come from engine.core.demo's PCG64 stream (byte-identical everywhere), in this file's tensor order.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.core import demo

VISION_ID = "v100plan-demo-vision"
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # ids 256.. after the demo's
VISION = {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
          "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
          "out_hidden_size": 256, "num_position_embeddings": 256, "hidden_act": "gelu_pytorch_tanh",
          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 64 * 64,
                "longest_edge": 256 * 256}, "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_rescale": True, "do_normalize": True}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def config(seed: int) -> dict:
    text = {k: v for k, v in demo.HYBRID_CONFIG.items() if k not in ("architectures", "v100plan", "torch_dtype")}
    vocab = text["vocab_size"] + len(SPECIAL)
    # mrope_section: the 8 rotary frequencies of the demo's 16 rotated head dimensions dealt 3 / 3 / 2
    text.update(vocab_size=vocab, rope_parameters=dict(text["rope_parameters"], mrope_section=[3, 3, 2],
                                                       mrope_interleaved=True))
    ids = {t: demo.HYBRID_CONFIG["vocab_size"] + i for i, t in enumerate(SPECIAL)}
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "vision_config": dict(VISION), "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"], "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": [2, 7], "torch_dtype": "float32",
            "v100plan": {"model_id": VISION_ID, "seed": seed, "add_bos_token": True}}


def tensor_names(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """The decoder's tensors (engine.core.demo.hybrid_tensors) under the wrapper's prefix, then the tower's."""
    from engine.core import config as ecfg
    from engine.vision import config as vconfig
    from engine.vision.tower import PREFIX, tensor_shapes

    out = [(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n, s, f)
           for n, s, f in demo.hybrid_tensors(ecfg.from_dict(cfg))]
    for name, shape in tensor_shapes(vconfig.from_dict(cfg)).items():
        family = ("one" if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else
                  "norm" if len(shape) == 1 or name.startswith("pos_embed") else
                  "down" if name.endswith("linear_fc2.weight") else "attn")
        out.append((PREFIX + name, shape, family))
    return out


def make(out_dir: str | Path, seed: int | None = None) -> dict:
    from tokenizers import AddedToken

    seed = demo.HYBRID_SEED if seed is None else seed
    cfg = config(seed)
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = demo.weights_bytes(seed, cfg, tensor_names(cfg))
    demo.write_safetensors(d / "model.safetensors", tensors, {"format": "pt", "model_id": VISION_ID, "seed": str(seed)})
    tok = demo.build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.save(str(d / "tokenizer.json"))
    spec = json.loads(demo.VOCAB_FILE.read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "chat_template": CHAT_TEMPLATE, "model_max_length": cfg["text_config"]["max_position_embeddings"],
        "additional_special_tokens": spec["special"][4:] + SPECIAL}, indent=2, sort_keys=True) + "\n")
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2, sort_keys=True) + "\n")
    return {"model_id": VISION_ID, "arch": "qwen3_5", "vision": True, "dir": str(d),
            "parameters": sum(len(b) // 4 for _, b in tensors.values()), "seed": seed,
            "files": sorted(p.name for p in d.iterdir())}
