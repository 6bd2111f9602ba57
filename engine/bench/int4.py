"""`python -m engine.bench.int4`: the int4 GEMV (engine.kernels.gemv_int4) on the 27B shape's matrices against the
card's read bandwidth, the prefill product on packed weights, and the fused decode kernels in fp16 against bf16
(the V100's dtype, timed on this card as a stand-in), printed as one JSON document.

What each number is (every time a median over CUDA-graph replays: engine.core.timing):
  read_bw_gbps             sum over a 4 GiB float32 buffer: the card's measured read bandwidth
  int4[set][matrix]        per block configuration
                           (BLOCK_N, BLOCK_K, num_warps, split-K, pipeline stages, form): L distinct packed matrices (one
                           per layer, together well past L2) multiplied by one row in one graph, us per matrix;
                           bytes = packed weights + zero points + scales; gbps = bytes / time; fraction = gbps /
                           read_bw_gbps. Every configuration is first checked against dequantise-then-matmul in
                           float32 (relative L2 error < 1e-2, else not timed). "best" = the fastest per matrix,
                           also with the norm (q/k/v, gate/up) or SiLU (down) prologue the decode step runs;
                           "best_blocks" is what --write-table merges into a tuning table (engine.tuning).
  prefill[set][matrix]     a chunk of --chunk tokens: the matrix dequantised by one kernel (gemv_int4.dequantise)
                           then cuBLAS, against cuBLAS on a bf16 matrix already in memory: ms and TFLOP/s
  fp16_vs_bf16             the dense fused kernels (norm + GEMV, SiLU + GEMV, the one-query attention) on the
                           27B shape at TP1 in fp16 and bf16: us each and the fp16 / bf16 ratio
  step[ctx]                the whole decode step of --config (the 27B hybrid shape) with every layer matrix packed
                           (MLP, attention, and the Gated DeltaNet in/out projections; embedding and head dense),
                           as the service replays it (engine.bench.decode.decode: the Decoder's graphs), against
                           its floor (weights + K/V + linear-attention state bytes) / read bandwidth
The weights are random (shapes and bytes are what the speed depends on), made on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# the 27B hybrid shape (hidden 5120, intermediate 17408; full attention 24 q heads (with the output gate: 2 x 24),
# 4 kv heads of 256), per rank: (N outputs, K inputs); TP2 splits N of column-parallel, K of row-parallel matrices
SHAPES = {
    "27b-tp1": {"gate_up": (2 * 17408, 5120), "down": (5120, 17408), "q_gate": (2 * 24 * 256, 5120),
                "k_or_v": (4 * 256, 5120), "o_proj": (5120, 24 * 256)},
    "27b-tp2": {"gate_up": (17408, 5120), "down": (5120, 8704), "q_gate": (24 * 256, 5120),
                "k_or_v": (2 * 256, 5120), "o_proj": (5120, 12 * 256)},
}
PROLOGUE_OF = {"gate_up": "norm", "q_gate": "norm", "k_or_v": "norm", "down": "silu", "o_proj": "plain"}
CONFIGS = [
    # the float32-planes form (blocks[5] = 0): the 2026-12-02 recording's winners
    (32, 128, 1, 8, 2, 0), (128, 256, 4, 8, 1, 0), (64, 128, 2, 8, 2, 0),
    # the fp16-pairs form (blocks[5] = 1; 16-bit activations): no prefetch, and one tile ahead in registers
    (32, 128, 1, 8, 1, 1), (32, 128, 1, 4, 1, 1), (64, 256, 2, 8, 1, 1), (16, 128, 1, 8, 1, 1),
    (32, 128, 1, 8, 2, 1), (64, 128, 2, 8, 2, 1), (128, 128, 4, 8, 2, 1),
    (64, 128, 4, 4, 2, 1), (32, 128, 2, 8, 2, 1), (128, 128, 8, 4, 2, 1), (64, 128, 4, 32, 2, 1),
    (64, 128, 4, 8, 2, 1), (64, 128, 4, 16, 2, 1), (64, 128, 4, 8, 1, 1),
]
# (BLOCK_N, BLOCK_K, num_warps, split: programs along K, stages: 2 = the next tile's loads issued before this
# tile's arithmetic, 1 = not; form: 0 = float32 planes, 1 = fp16 pairs)
L2_SPAN_BYTES = 512 * 2 ** 20  # at least this many weight bytes per graph, so no matrix is read from L2


def _configs(text: str) -> list[tuple[int, ...]]:
    try:
        out = [tuple(int(v) for v in part.split(",")) for part in text.split(";") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--configs: {text!r} is not ';'-separated BN,BK,warps,split,stages,form") from None
    if not out or any(len(c) != 6 or c[4] not in (1, 2) or c[5] not in (0, 1) for c in out):
        raise argparse.ArgumentTypeError("--configs: each configuration has six numbers (BN,BK,warps,split,stages,form)"
                                         ", stages 1 or 2, form 0 (planes) or 1 (pairs)")
    return out


def _layouts(text: str) -> list[int]:
    """--layouts: 0 (rows) or TB (tiles of TB rows)."""
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layouts: {text!r} is not comma-separated tile rows (0 = rows)") from None
    if not out or any(tb < 0 or tb & (tb - 1) for tb in out):
        raise argparse.ArgumentTypeError("--layouts: each is 0 (rows) or a power of two (tile rows)")
    return out


def _packed(n: int, k: int, group: int, dev, g):
    import torch

    from engine.core import quant

    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device=dev, generator=g)
    zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // group, n // 8), dtype=torch.int32, device=dev, generator=g)
    scales = (0.001 + 0.002 * torch.rand(k // group, n, device=dev, generator=g)).half()
    return quant.PackedLinear(words, zeros, scales, None, group, 1, f"gptq-int4-g{group}")


def _us(fn, count: int) -> float:
    """us per call of ``count`` calls in one CUDA graph (engine.bench.gemv's timing)."""
    from engine.bench.gemv import _us as graph_us

    return graph_us(fn, count)


def fixed_and_stream(points: list[tuple[int, float]], read_gbps: float) -> dict:
    """A least-squares line through (bytes, us) of the matrices' fastest products: us = fixed + bytes / stream.
    ``fixed_us`` is what a product costs whatever its size (the row kernel, the first loads' latency, split-K's
    last program, the gap to the next kernel), ``stream_fraction`` the rate of the bytes past it against the card's
    read bandwidth, ``max_rel_residual`` how far the worst matrix lies off the line, and ``cap_fraction`` the
    bytes-weighted fraction these matrices would reach at the fitted stream rate with no fixed cost."""
    n = len(points)
    if n < 2 or len({b for b, _ in points}) < 2:
        raise ValueError("the fit needs at least two matrices of different sizes")
    mb = sum(b for b, _ in points) / n
    mt = sum(t for _, t in points) / n
    slope = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)  # us per byte
    fixed = mt - slope * mb
    stream_gbps = 1e-3 / slope if slope > 0 else float("inf")
    resid = max(abs(fixed + slope * b - t) / t for b, t in points)
    total_b = sum(b for b, _ in points)
    return {"matrices": n, "fixed_us": round(fixed, 3), "stream_gbps": round(stream_gbps, 1),
            "stream_fraction": round(stream_gbps / read_gbps, 4), "max_rel_residual": round(resid, 4),
            "fixed_share": round(n * fixed / sum(t for _, t in points), 4),
            "cap_fraction": round(total_b / (total_b * slope * 1e-6) / 1e9 / read_gbps, 4)}


def int4_gemv(args, doc: dict) -> None:
    import torch
    import torch.nn.functional as F

    from engine.kernels import gemv, gemv_int4

    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    act = getattr(torch, args.dtype)
    read = doc["read_bw_gbps"]
    held: dict[int, list] = {}  # tile rows -> the matrices held in tiles of that many rows
    for set_name in args.shapes.split(","):
        doc["int4"][set_name] = {}
        for name, (n, k) in SHAPES[set_name].items():
            rows_held = [_packed(n, k, args.group, dev, g)]
            count = max(2, min(64, -(-L2_SPAN_BYTES // rows_held[0].nbytes)))
            rows_held += [_packed(n, k, args.group, dev, g) for _ in range(count - 1)]
            x = torch.randn(k, device=dev, generator=g).to(act)
            ref = F.linear(x.float(), rows_held[0].dequantise(torch.float32))
            outs = [torch.empty(n, device=dev, dtype=act) for _ in rows_held]
            row = {"n": n, "k": k, "matrices": count, "bytes": rows_held[0].nbytes, "configs": {}}
            best = None
            for tb, cfg0 in [(tb, c) for tb in args.layouts for c in (args.configs or CONFIGS)]:
                cfg = (cfg0[0], min(cfg0[1], k), *cfg0[2:])
                key = "x".join(map(str, cfg)) + (f"-t{tb}" if tb else "")
                if key in row["configs"]:
                    continue
                if tb and tb not in held:
                    held[tb] = [w.tiled(tb) for w in rows_held]
                ws = held[tb] if tb else rows_held
                one = ws[0]
                if tb and not one.tile_rows:
                    row["configs"][key] = {"skipped": f"cannot be held in tiles of {tb} rows"}
                    continue
                try:
                    gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, one, None, outs[0], blocks=cfg)
                    err = float((outs[0].float() - ref).norm() / ref.norm())
                    if err > 1e-2:
                        row["configs"][key] = {"rel_err": round(err, 6), "skipped": "error over 1e-2"}
                        continue
                    us = _us(lambda c=cfg: [gemv_int4.launch(gemv.PROLOGUE_PLAIN, x, w, None, o, blocks=c)
                                            for w, o in zip(ws, outs)], count)
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile is reported
                    row["configs"][key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    continue
                gbps = one.nbytes / (us * 1e-6) / 1e9
                row["configs"][key] = {"us": round(us, 3), "gbps": round(gbps, 1), "fraction": round(gbps / read, 4),
                                       "rel_err": round(err, 6)}
                lay = f"t{tb}" if tb else "rows"
                if best is None or us < best[1]:
                    best = (cfg, us, tb)
                if lay not in row.setdefault("best_by_layout", {}) or us < row["best_by_layout"][lay]["us"]:
                    row["best_by_layout"][lay] = {"blocks": list(cfg), "us": round(us, 3),
                                                  "fraction": round(gbps / read, 4)}
            if best is not None:
                cfg, us, tb = best
                ws = rows_held if not tb else held[tb]
                one = ws[0]
                pro = PROLOGUE_OF[name]
                d = torch.randn(k, device=dev, generator=g).to(act)
                nw = torch.ones(k, device=dev, dtype=act)
                gu = torch.randn(2 * k, device=dev, generator=g).to(act)
                xo = torch.empty(k, device=dev, dtype=act)
                if pro == "norm":
                    us_p = _us(lambda: [gemv_int4.launch(gemv.PROLOGUE_NORM, x, w, None, o, d, nw, 1e-6, xo, blocks=cfg)
                                    for w, o in zip(ws, outs)], count)
                elif pro == "silu":
                    us_p = _us(lambda: [gemv_int4.launch(gemv.PROLOGUE_SILU, gu, w, None, o, blocks=cfg)
                                    for w, o in zip(ws, outs)], count)
                else:
                    us_p = us
                sub = min(cfg[1], args.group)
                form = cfg[5] if len(cfg) > 5 else gemv_int4.DEFAULT_FORM
                pairs = form == gemv_int4.FORM_PAIRS and act in gemv_int4.PAIR_DTYPES
                row_us = _us(lambda: [gemv_int4.row_input(gemv.PROLOGUE_NORM if pro == "norm" else gemv.PROLOGUE_SILU
                                                          if pro == "silu" else gemv.PROLOGUE_PLAIN,
                                                          gu if pro == "silu" else x, w, sub, d, nw, 1e-6, xo,
                                                          pairs=pairs)
                                      for w in ws], count)
                gbps = one.nbytes / (us * 1e-6) / 1e9
                row["best"] = {"blocks": list(cfg), "tile_rows": tb, "us": round(us, 3), "gbps": round(gbps, 1),
                               "fraction": round(gbps / read, 4), "prologue": pro, "prologue_us": round(us_p, 3),
                               "prologue_fraction": round(one.nbytes / (us_p * 1e-6) / 1e9 / read, 4),
                               "row_kernel_us": round(row_us, 3)}
                doc["best_blocks"][f"{pro}:{n}x{k}"] = list(cfg)
            doc["int4"][set_name][name] = row
            ws = outs = rows_held = one = None  # freed before the next matrix
            held.clear()
            torch.cuda.empty_cache()
    fr = [r["best"]["fraction"] for s in doc["int4"].values() for r in s.values() if "best" in r]
    tot_b = sum(r["bytes"] for s in doc["int4"].values() for r in s.values() if "best" in r)
    tot_us = sum(r["best"]["us"] for s in doc["int4"].values() for r in s.values() if "best" in r)
    doc["int4_summary"] = {"min_fraction": min(fr) if fr else None,
                           "bytes_weighted_fraction": round(tot_b / (tot_us * 1e-6) / 1e9 / read, 4) if fr else None,
                           "target_fraction": 0.75, "by_layout": {}}
    best_rows = [r for s in doc["int4"].values() for r in s.values() if "best" in r]
    if len(best_rows) >= 3:
        doc["int4_summary"]["fit"] = fixed_and_stream([(r["bytes"], r["best"]["us"]) for r in best_rows], read)
    rows_ = [r for s in doc["int4"].values() for r in s.values()]
    for lay in sorted({lay for r in rows_ for lay in r.get("best_by_layout", {})}):
        have = [r for r in rows_ if lay in r.get("best_by_layout", {})]
        b = sum(r["bytes"] for r in have)
        t = sum(r["best_by_layout"][lay]["us"] for r in have)
        doc["int4_summary"]["by_layout"][lay] = {"matrices": len(have),
                                                 "bytes_weighted_fraction": round(b / (t * 1e-6) / 1e9 / read, 4)}


def prefill(args, doc: dict) -> None:
    import torch
    import torch.nn.functional as F

    from engine.kernels import gemv_int4

    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(1)
    act = getattr(torch, args.dtype)
    for set_name in args.shapes.split(","):
        doc["prefill"][set_name] = {}
        for name, (n, k) in SHAPES[set_name].items():
            w = _packed(n, k, args.group, dev, g)
            x = torch.randn(args.chunk, k, device=dev, generator=g).to(act)
            dense = w.dequantise_held(act)
            flops = 2.0 * args.chunk * n * k
            deq_us = _us(lambda: gemv_int4.dequantise(w, act), 1)
            packed_us = _us(lambda: F.linear(x, gemv_int4.dequantise(w, act)), 1)
            dense_us = _us(lambda: F.linear(x, dense), 1)
            doc["prefill"][set_name][name] = {
                "tokens": args.chunk, "dequantise_us": round(deq_us, 1), "packed_us": round(packed_us, 1),
                "dense_us": round(dense_us, 1), "packed_tflops": round(flops / (packed_us * 1e-6) / 1e12, 1),
                "dense_tflops": round(flops / (dense_us * 1e-6) / 1e12, 1)}
            dense = x = None
            torch.cuda.empty_cache()


def fp16_vs_bf16(args, doc: dict) -> None:
    """The dense fused kernels of one 27B full-attention layer at TP1, fp16 against bf16 (random weights)."""
    import torch

    from engine.kernels import attention, gemv

    dev = torch.device(args.device)
    d, ff, heads, kv, hd = 5120, 17408, 24, 4, 256
    window = args.window
    out = {}
    for dt in (torch.bfloat16, torch.float16):
        g = torch.Generator(device=dev).manual_seed(2)
        e = dict(device=dev, dtype=dt)
        count = 4  # four layers' weights per graph (gate/up alone is 356 MB in 16 bits)
        wqkv = [torch.empty((heads + 2 * kv) * hd, d, **e).normal_(0, 0.02, generator=g) for _ in range(count)]
        w13 = [torch.empty(2 * ff, d, **e).normal_(0, 0.02, generator=g) for _ in range(count)]
        w2 = [torch.empty(d, ff, **e).normal_(0, 0.02, generator=g) for _ in range(count)]
        x, dl = torch.randn(1, 1, d, **e), torch.randn(1, 1, d, **e)
        nw = torch.ones(d, **e)
        gu = torch.randn(1, 1, 2 * ff, **e)
        qkv = torch.randn(1, 1, (heads + 2 * kv) * hd, **e)
        kc, vc = torch.randn(1, kv, window, hd, **e), torch.randn(1, kv, window, hd, **e)
        cos, sin = torch.ones(1, hd, **e), torch.zeros(1, hd, **e)
        pos = torch.tensor([window - 1], device=dev)
        qn = kn = torch.ones(hd, **e)
        attention.decode_attention(qkv, cos, sin, pos, qn, kn, kc, vc, n_heads=heads, n_kv=kv, hd=hd, eps=1e-6,
                                   window=window)  # the counters, before capture
        name = str(dt).removeprefix("torch.")
        out[name] = {
            "norm_qkv_us": round(_us(lambda: [gemv.linear_norm(x, dl, nw, 1e-6, w) for w in wqkv], count), 2),
            "norm_gate_up_us": round(_us(lambda: [gemv.linear_norm(x, dl, nw, 1e-6, w) for w in w13], count), 2),
            "silu_down_us": round(_us(lambda: [gemv.linear_silu(gu, w) for w in w2], count), 2),
            "attention_us": round(_us(lambda: attention.decode_attention(
                qkv, cos, sin, pos, qn, kn, kc, vc, n_heads=heads, n_kv=kv, hd=hd, eps=1e-6, window=window), 1), 2)}
        if args.silu_blocks:  # SiLU + down under other blocks (BLOCK_N, BLOCK_K, warps), each dtype: the 27B
            # shape's down (5120 x 17408) and the 8B dense one's (4096 x 12288, TP1; 4096 x 6144, TP2)
            by = out[name]["silu_down_by_blocks"] = {}
            for n_out, k_in in ((d, ff), (4096, 12288), (4096, 6144)):
                ws = w2 if (n_out, k_in) == (d, ff) else [
                    torch.empty(n_out, k_in, **e).normal_(0, 0.02, generator=g) for _ in range(count)]
                gx, o = torch.randn(2 * k_in, **e), torch.empty(n_out, **e)
                by[f"{n_out}x{k_in}"] = {"x".join(map(str, b)): round(_us(lambda b=b, ws=ws, gx=gx, o=o: [
                    gemv.launch_prologue(gemv.PROLOGUE_SILU, gx, w, None, o, blocks=b) for w in ws], count), 2)
                    for b in args.silu_blocks}
                ws = None
        wqkv = w13 = w2 = None
        torch.cuda.empty_cache()
    bf, fp = out["bfloat16"], out["float16"]
    out["ratio_fp16_over_bf16"] = {k: round(fp[k] / bf[k], 4) for k in bf if k != "silu_down_by_blocks"}
    out["window"] = window
    doc["fp16_vs_bf16"] = out


PACKED_ATTRS = ("wqkv", "wo", "w13", "w2", "w_in", "w_out")  # every layer matrix the step can run packed


def pack_layers(model, group: int, g) -> None:
    """Every layer matrix of ``model`` (each mixer's and its MLP's: PACKED_ATTRS) replaced by a random packed one of
    its shape, held as the GPU's GEMV reads it; embedding and head stay dense. Call before weights.init_random."""
    from engine.kernels import gemv_int4

    for layer in model.layers:
        for block in (layer, layer.mlp):
            for attr in PACKED_ATTRS:
                t = getattr(block, attr, None)
                if t is not None:
                    setattr(block, attr, gemv_int4.held(_packed(*t.shape, group, model.device, g), model.device))


def step(args, doc: dict) -> None:
    import dataclasses
    import json as _json
    from pathlib import Path

    import torch

    from engine.bench import decode as dbench
    from engine.core import config as ecfg
    from engine.core import quant_config, weights
    from engine.core.model import Model

    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(3)
    cfg = ecfg.from_dict(_json.loads(Path(args.config).read_text()))
    q = quant_config.parse({"quant_method": "gptq", "bits": 4, "group_size": args.group, "sym": True,
                            "desc_act": False})
    cfg = dataclasses.replace(cfg, quantization=q)
    contexts = [int(c) for c in args.contexts.split(",")]
    with torch.inference_mode():
        model = Model(cfg, dtype=getattr(torch, args.dtype), device=dev)
        pack_layers(model, args.group, g)
        weights.init_random(model)
        model.setup_cache(max(contexts) + 256)
    packed = sum(p.nbytes for p in model.packed())
    doc["step"] = {"config": args.config, "weight_bytes": model.weight_bytes(), "packed_bytes": packed,
                   "contexts": dbench.decode(model, contexts, None, doc["read_bw_gbps"], profile=args.profile)}
    del model
    torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.int4", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--group", type=int, default=128, choices=(32, 64, 128), help="group size (default: 128)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="activations (bfloat16)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per chunk (default: 2048)")
    p.add_argument("--window", type=int, default=4096, help="the attention's window in fp16_vs_bf16 (default: 4096)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: int4, prefill, fp16, step")
    p.add_argument("--config", default="engine/data/qwen3.5-27b.config.json", help="step: the model shape")
    p.add_argument("--contexts", default="1024,131072", help="step: contexts to time (default: 1024,131072)")
    p.add_argument("--silu-blocks", default=None, type=lambda t: [tuple(int(v) for v in c.split(",")) for c in
                                                                   t.split(";") if c.strip()],
                   help="fp16: also time SiLU + down with these blocks, ';'-separated BLOCK_N,BLOCK_K,warps")
    p.add_argument("--profile", action="store_true",
                   help="step: also record where each step's time goes (torch.profiler: kernels, busy and idle time)")
    p.add_argument("--configs", default=None, type=_configs,
                   help="int4: the block configurations to time, ';'-separated, each BN,BK,warps,split,stages,form "
                        "(default: CONFIGS)")
    p.add_argument("--layouts", default="0,32", type=_layouts,
                   help="int4: how the words are held, comma-separated: 0 = in rows, TB = in tiles of TB rows "
                        "(quant.PackedLinear.tiled; default: 0,32)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--write-table", default=None, metavar="FILE",
                   help="int4: merge the fastest blocks per matrix into this tuning table (e.g. "
                        "engine/tuning/hopper.json), which the step then runs")
    args = p.parse_args(argv)
    args.device = "cuda:0"
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        print(f"Error: unknown shape set(s) {bad}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("Error: this bench needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 4
    from engine.core import timing
    from profiles.document import utc_now

    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    torch.set_grad_enabled(False)
    doc: dict = {"kind": "engine_bench_int4", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev),
                 "capability": list(torch.cuda.get_device_capability(dev)), "torch": torch.__version__,
                 "group_size": args.group, "dtype": args.dtype, "method": __doc__.strip(),
                 "read_bw_gbps": round(timing.read_bandwidth_gbps(dev), 1), "int4": {}, "best_blocks": {},
                 "prefill": {}}
    try:
        import triton

        doc["triton"] = triton.__version__
    except ImportError:
        print("Error: the int4 kernels need Triton (pip install triton)", file=sys.stderr)
        return 4
    t0 = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))
    if "int4" not in skip:
        int4_gemv(args, doc)
    if "prefill" not in skip:
        prefill(args, doc)
    if "fp16" not in skip:
        fp16_vs_bf16(args, doc)
    if args.write_table and doc["best_blocks"]:  # the winners into a tuning table, which the step's decoder reads
        from engine import tuning

        tuning.write(args.write_table, "int4", doc["best_blocks"], measured_on=doc["device"])
        os.environ[tuning.OVERRIDE_ENV] = args.write_table
    if "step" not in skip:
        step(args, doc)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
