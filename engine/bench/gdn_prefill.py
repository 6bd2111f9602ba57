"""`python -m engine.bench.gdn_prefill`: the Gated DeltaNet prefill (engine.kernels.gdn_chunk) against the torch
chunked form (engine.kernels.gdn.chunked) at a config.json's shape, random inputs on the GPU, printed as JSON.

  layer[variant]   one linear-attention layer's rule over one prefill chunk (--chunk tokens, the layer's heads):
                   wall ms (synchronised), host ms (the call returning, before the GPU is done: the launches'
                   CPU time) and device ms (the sum of its kernels' times, torch.profiler); the kernel's variants
                   (value columns per program, pipelining stages, the parts kernel vs the torch form's batched parts),
                   each with its error against the torch form in float32 on the same inputs
  prefill[kernels][tokens]  the whole model's prefill (engine.bench.decode.prefill: the `python -m engine bench`
                   figure) with the model's kernel choice "eager" (gdn.chunked) and "fused" (gdn_chunk), its TFLOP/s
                   and share of --peak-tflops
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from engine import DATA_DIR
from engine.bench.decode import emit_json, prefill


def _inputs(cfg, t: int, dtype, device):
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    q = torch.randn(t, hk, dk, generator=g, device=device).to(dtype)
    k = torch.randn(t, hk, dk, generator=g, device=device).to(dtype)
    v = torch.randn(t, hv, dv, generator=g, device=device).to(dtype)
    decay = -torch.rand(t, hv, generator=g, device=device) * 0.5  # g = -exp(A_log) softplus(.): a few tenths
    beta = torch.rand(t, hv, generator=g, device=device).to(dtype)
    s0 = torch.randn(hv, dk, dv, generator=g, device=device) * 0.1
    return q, k, v, decay, beta, s0


def _time(fn, repeats: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    wall, host = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        wall.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    row = {"wall_ms": round(statistics.median(wall), 4), "host_ms": round(statistics.median(host), 4)}
    if cuda:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync()
        dev_us = sum(e.self_device_time_total for e in prof.key_averages())
        row["device_ms"] = round(dev_us / 1e3, 4)
        row["kernels"] = sum(e.count for e in prof.key_averages() if e.self_device_time_total > 0)
    return row


def layer_bench(cfg, tokens: int, dtype, device, repeats: int) -> dict:
    """One layer's rule over one prefill chunk: the torch form and the kernel's variants."""
    import torch

    from engine.kernels import gdn, gdn_chunk

    q, k, v, decay, beta, s0 = _inputs(cfg, tokens, dtype, device)
    ref_o, ref_s = gdn.chunked(q.float(), k.float(), v.float(), decay, beta.float(), s0)

    def err(o, s):
        return {"out_rel_err": round(((o - ref_o).norm() / ref_o.norm()).item(), 6),
                "state_rel_err": round(((s - ref_s).norm() / ref_s.norm()).item(), 6)}

    out = {"tokens": tokens, "dtype": str(dtype).replace("torch.", ""), "heads": [q.shape[1], v.shape[1]],
           "dk": q.shape[2], "dv": v.shape[2]}
    row = _time(lambda: gdn.chunked(q, k, v, decay, beta, s0), repeats)
    out["torch_chunked"] = {**row, **err(*gdn.chunked(q, k, v, decay, beta, s0))}
    dv = v.shape[2]
    variants = [(bv, None, "kernel") for bv in (16, 32, 64) if bv <= dv]
    variants += [(32, 1, "kernel"), (32, 3, "kernel"), (32, None, "torch")]
    for bv, st, prep in variants:
        kw = dict(bv=bv, num_stages=st, prep=prep)
        name = f"kernel_bv{bv}_st{st or 'default'}_{prep}_parts"
        try:
            row = _time(lambda kw=kw: gdn_chunk.chunked(q, k, v, decay, beta, s0, **kw), repeats)
            out[name] = {**row, **err(*gdn_chunk.chunked(q, k, v, decay, beta, s0, **kw))}
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported, the others still run
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    # the intra-chunk parts alone: the parts kernel and the torch form's batched parts
    out["parts_kernel_only"] = _time(lambda: gdn_chunk.prepare(q, k, v, decay, beta), repeats)
    out["parts_torch_only"] = _time(lambda: gdn.chunk_parts(q, k, v, decay, beta), repeats)
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.gdn_prefill", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"))
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--chunk", type=int, default=2048, help="tokens per prefill chunk")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--prefill-tokens", default="8192", help="whole-model prompts, comma-separated ('' : none)")
    p.add_argument("--eager-tokens", default="8192", help="of those, the ones also prefilled with gdn.chunked")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model

    if not torch.cuda.is_available():
        print(json.dumps({"error": "this benchmark needs a CUDA GPU"}))
        return 4
    from profiles.document import utc_now

    raw = json.loads(Path(args.config).read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
        raw.pop("layer_types", None)
    cfg = ecfg.from_dict(raw)
    dev = torch.device("cuda:0")
    import triton

    doc = {"kind": "gdn_prefill_bench", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "triton": triton.__version__, "config": Path(args.config).name,
           "num_layers": cfg.num_layers, "chunk": args.chunk, "peak_tflops": args.peak_tflops}
    torch.set_grad_enabled(False)
    if not args.skip_layer:
        doc["layer"] = layer_bench(cfg, args.chunk, torch.bfloat16, dev, args.repeats)
        emit_json(doc, args.out)
    lengths = [int(t) for t in args.prefill_tokens.split(",") if t]
    if lengths:
        model = Model(cfg, dtype=torch.bfloat16, device=dev)
        weights.init_random(model)
        model.setup_cache(-(-max(lengths) // 256) * 256 + 256)
        doc["prefill"] = {}
        eager = {int(t) for t in args.eager_tokens.split(",") if t}
        for kernels in ("eager", "fused"):
            model.kernels = kernels
            for n in lengths:
                if kernels == "eager" and n not in eager:
                    continue
                with torch.inference_mode():
                    row = prefill(model, n, args.chunk, repeats=3 if n <= 16384 else 1)
                row["compute_fraction"] = round(row["tflops"] / args.peak_tflops, 4)
                doc["prefill"].setdefault(kernels, {})[str(n)] = row
                emit_json(doc, args.out)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
