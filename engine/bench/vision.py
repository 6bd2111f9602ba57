"""`python -m engine.bench.vision`: the vision tower's time for one image and the time to first token of a chat
with that image, on the 27B shape with random weights, each predicted before it is measured.

Predictions (printed before the measurements run): the tower's matrix products (patch embedding, 27 blocks'
qkv / proj / MLP, the merger) at the rate this card reaches on the tower's own MLP product, plus its attention
(4 x patches^2 x hidden per block) at the rate SDPA reaches on one block's attention; the TTFT adds the
decoder's prefill of the prompt (2 x decoder parameters x tokens at the rate of its MLP product; the Gated
DeltaNet and attention mixing are not in it, so the prediction is a floor). Measured: the tower's forward
(median of --repeats after a warm-up), and a cold request (no prefix cache, no encoder cache) through the
engine's own path: engine.vision.prompt.Vision.begin + engine.core.runner.run for one token, CUDA-synchronised.
One process, one GPU (TP1: the tower is replicated under TP2, so a rank's tower time is this one). Prints one
JSON document (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from engine import DATA_DIR


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn, repeats: int) -> float:
    fn()
    _sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _gemm_tflops(m: int, k: int, n: int, dtype, device) -> float:
    import torch

    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device)
    ms = _median_ms(lambda: torch.nn.functional.linear(a, b), 10)
    return 2 * m * k * n / (ms * 1e-3) / 1e12


def _attn_tflops(n: int, heads: int, hd: int, dtype, device) -> float:
    import torch

    q = torch.randn(1, heads, n, hd, dtype=dtype, device=device)
    ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q), 10)
    return 4 * n * n * heads * hd / (ms * 1e-3) / 1e12


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.vision", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"), help="the text decoder's shape")
    p.add_argument("--vision", default=str(DATA_DIR / "qwen3.5-27b-vision.json"), help="the tower's shape")
    p.add_argument("--layers", type=int, default=None, help="decoder layers kept (default: all)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on compute capability >= 8.0, else float16")
    p.add_argument("--image-size", type=int, default=1024, help="a square image of this many pixels a side")
    p.add_argument("--text-tokens", type=int, default=32, help="text tokens of the chat around the image")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import numpy as np
    import torch
    from PIL import Image

    from engine.core import config as ecfg
    from engine.core import runner
    from engine.core.model import Model
    from engine.core.sampling import Sampler
    from engine.vision import config as vconfig
    from engine.vision.preprocess import pixels
    from engine.vision.prompt import Vision
    from engine.vision.tower import Tower

    dev = torch.device(args.device)
    major = 0
    if dev.type == "cuda":  # (--device cpu: a smoke run of the script on a small --config)
        torch.cuda.set_device(dev)
        major, _ = torch.cuda.get_device_capability(dev)
    dtype = getattr(torch, args.dtype or ("bfloat16" if major >= 8 else "float16" if major else "float32"))
    text = json.loads(Path(args.config).read_text())
    if args.layers:
        text["num_hidden_layers"] = args.layers
        text.pop("layer_types", None)
    vis_raw = json.loads(Path(args.vision).read_text())
    text["rope_parameters"] = dict(text.get("rope_parameters") or {}, mrope_section=vis_raw["mrope_section"])
    raw = {"model_type": "qwen3_5", "text_config": dict(text, model_type="qwen3_5_text"),
           **{k: v for k, v in vis_raw.items() if k not in ("source", "mrope_section")}}
    cfg, vcfg = ecfg.from_dict(raw), vconfig.from_dict(raw)
    rules = vconfig.ImageRules(min_pixels=vconfig.MIN_PIXELS, max_pixels=vconfig.MAX_PIXELS,
                               patch_size=vcfg.patch_size, temporal_patch_size=vcfg.temporal_patch_size,
                               merge_size=vcfg.spatial_merge_size, mean=vconfig.MEAN_STD, std=vconfig.MEAN_STD)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (args.image_size, args.image_size, 3),
                                                             dtype=np.uint8))
    pix = pixels(img, rules)
    patches = pix.values.shape[0]
    n_img = pix.tokens(vcfg.spatial_merge_size)
    doc: dict = {"kind": "engine_bench_vision", "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype)[6:],
                 "config": Path(args.config).name, "vision": Path(args.vision).name,
                 "layers": cfg.num_layers, "image": f"{args.image_size}x{args.image_size}", "patches": patches,
                 "image_tokens": n_img, "tower_params": vcfg.param_count(), "torch": torch.__version__,
                 "method": __doc__.strip()}

    def emit():
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    # ---- predictions ------------------------------------------------------------------------------
    d, f = vcfg.hidden_size, vcfg.intermediate_size
    tower_gemm = _gemm_tflops(patches, d, f, dtype, dev)
    attn_rate = _attn_tflops(patches, vcfg.num_heads, vcfg.head_dim, dtype, dev)
    attn_flops = vcfg.depth * 4 * patches * patches * d
    mat_flops = vcfg.flops(patches) - attn_flops
    tower_pred_ms = (mat_flops / (tower_gemm * 1e12) + attn_flops / (attn_rate * 1e12)) * 1e3
    tokens = n_img + args.text_tokens
    dec_gemm = _gemm_tflops(tokens, cfg.hidden_size, cfg.intermediate_size, dtype, dev)
    # the embedding table is read, not multiplied; the output head multiplies the last position only
    dec_params = cfg.param_count() - cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    prefill_pred_ms = 2 * dec_params * tokens / (dec_gemm * 1e12) * 1e3
    doc["predicted"] = {"tower_ms": round(tower_pred_ms, 2), "ttft_ms": round(tower_pred_ms + prefill_pred_ms, 2),
                        "prefill_ms": round(prefill_pred_ms, 2), "tower_matmul_tflops": round(tower_gemm, 2),
                        "tower_attention_tflops": round(attn_rate, 2), "decoder_matmul_tflops": round(dec_gemm, 2),
                        "tower_flops": vcfg.flops(patches), "prefill_flops": 2 * dec_params * tokens}
    emit()
    print(json.dumps({"predicted": doc["predicted"]}), flush=True)

    # ---- measurements -----------------------------------------------------------------------------
    torch.manual_seed(0)
    tower = Tower(vcfg, dtype, dev)
    for name, t in tower.w.items():
        t.normal_(0, 0.02) if t.ndim > 1 else t.fill_(1.0 if name.endswith("weight") else 0.0)
    pv = torch.from_numpy(pix.values).to(dev)
    doc["measured"] = {"tower_ms": round(_median_ms(lambda: tower.forward(pv, pix.grid), args.repeats), 2)}
    emit()
    model = Model(cfg, dtype=dtype, device=dev)
    for t in [model.embed, model.head, model.norm] + [w for la in model.layers for w in la.weights().values()]:
        t.normal_(0, 0.02)
    model.setup_cache(tokens + 64)
    runner.prepare(model, prefix_cache_bytes=0)
    vision = Vision(model, tower, vcfg, rules, cache_images=0)
    ids = ([11] * (args.text_tokens // 2) + [vcfg.vision_start_token_id] + [vcfg.image_token_id] * n_img
           + [vcfg.vision_end_token_id] + [13] * (args.text_tokens - args.text_tokens // 2 - 2))

    def request():
        keys = vision.begin(ids, [pix])
        try:
            runner.run(model, keys, 1, Sampler(), set(), 2048)
        finally:
            vision.end()

    doc["measured"]["ttft_ms"] = round(_median_ms(request, args.repeats), 2)
    doc["measured"]["weights_gb"] = round(model.weights_info()["bytes"] / 1e9, 2)
    doc["measured"]["tower_gb"] = round(tower.nbytes() / 1e9, 3)
    if dev.type == "cuda":
        doc["measured"]["peak_gb"] = round(torch.cuda.max_memory_allocated(dev) / 1e9, 2)
    emit()
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
