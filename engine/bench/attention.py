"""`python -m engine.bench.attention`: the decode step's one-query attention kernel alone (engine.kernels.decode,
the kernel the service runs) at long contexts, against the card's read bandwidth, per launch configuration.

For each shape (the 27B hybrid's attention: 24 query / 4 KV heads of 256, gated, quarter rotary; the 8B dense
one: 32 / 8 of 128), cache dtype (the model's bf16, int8 with its scales) and context, every configuration of
(positions per tile, warps, programs in all, tiles in flight, the step's own position attended apart from the
tiles) is checked against the default configuration's output, then timed as a CUDA graph of 20 launches over a rotating set of 2 caches (median of 5); K/V GB/s = the
cache bytes the step reads at that context (K, V and the int8 scales) / time. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

SHAPES = {
    "qwen3.5-27b": dict(n_heads=24, n_kv=4, hd=256, gated=True, zc=True, rot=64),
    "qwen3-8b": dict(n_heads=32, n_kv=8, hd=128, gated=False, zc=False, rot=128),
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.attention", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--contexts", default="131072,262144")
    p.add_argument("--kv", default="auto,int8")
    p.add_argument("--blocks", default="64,128", help="positions per tile")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--programs", default="264,528", help="programs in all (the window split over them)")
    p.add_argument("--stages", default="1,2")
    p.add_argument("--apart", default="0,1", help="0,1: the step's own position inside its tile / attended apart "
                                                   "(engine.kernels.decode.APART: the default when pipelined)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                   help="the model's dtype (16-bit caches are in it; float16 is the V100's)")
    p.add_argument("--permute", default=None, help="0,1: int8 caches in float16 widened by Triton / by the byte "
                                                   "permute (engine.kernels.decode.I8_PERMUTE); default: the "
                                                   "engine's choice")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from engine.core import kvquant, timing
    from engine.kernels import decode

    dev = torch.device("cuda")
    read = timing.read_bandwidth_gbps(dev, 4 << 30)
    doc: dict = {"kind": "engine_bench_attention", "device": torch.cuda.get_device_name(dev),
                 "torch": torch.__version__, "read_bw_gbps": round(read, 1), "method": __doc__.strip(), "rows": []}
    g = torch.Generator(device=dev).manual_seed(0)
    dt = getattr(torch, args.dtype)
    doc["dtype"] = args.dtype
    for shape in args.shapes.split(","):
        sh = SHAPES[shape]
        h, kv, hd = sh["n_heads"], sh["n_kv"], sh["hd"]
        for kvd, ctx in itertools.product(args.kv.split(","), (int(c) for c in args.contexts.split(","))):
            qrows = h * hd * (2 if sh["gated"] else 1)
            qkv = torch.randn(qrows + 2 * kv * hd, device=dev, generator=g).to(dt)
            cos = torch.randn(1, sh["rot"], device=dev, generator=g).to(dt)
            sin = torch.randn(1, sh["rot"], device=dev, generator=g).to(dt)
            qn = (0.1 * torch.randn(hd, device=dev, generator=g)).to(dt)
            kn = (0.1 * torch.randn(hd, device=dev, generator=g)).to(dt)
            pos = torch.tensor([ctx - 1], device=dev)
            caches = []
            for _ in range(2):  # rotate two caches so repeated launches do not read L2
                k = torch.randn(1, kv, ctx, hd, device=dev, generator=g).to(dt)
                v = torch.randn(1, kv, ctx, hd, device=dev, generator=g).to(dt)
                if kvd == "int8":
                    (kq, ks), (vq, vs) = kvquant.quantize(k), kvquant.quantize(v)
                    caches.append((kq, vq, ks, vs))
                else:
                    caches.append((k, v, None, None))
            nbytes = sum(t.numel() * t.element_size() for t in caches[0] if t is not None)

            def call(c, **kw):
                return decode.decode_attention(qkv, cos, sin, pos, qn, kn, c[0], c[1], n_heads=h, n_kv=kv, hd=hd,
                                               eps=1e-6, window=ctx, gated=sh["gated"], zc=sh["zc"],
                                               k_scale=c[2], v_scale=c[3], **kw)

            ref = call(caches[0]).float()
            perms = [None] if args.permute is None else [bool(int(v)) for v in args.permute.split(",")]
            grid = [None] + list(itertools.product(*(list(map(int, a.split(","))) for a in (
                args.blocks, args.warps, args.programs, args.stages, args.apart)), perms))
            for cfg in grid:
                if cfg is None:  # what the service runs at this shape and window: decode_attention's defaults
                    kw = {}
                    row = {"shape": shape, "kv": kvd, "context": ctx, "config": "default",
                           "apart": "pipelined" if decode.APART else False}
                else:
                    bs, warps, progs, stages, apart, perm = cfg
                    splits = max(1, progs // kv)
                    kw = dict(block_s=bs, num_warps=warps, splits=splits, stages=stages,
                              apart=bool(apart), permute=perm)
                    row = {"shape": shape, "kv": kvd, "context": ctx, "block_s": bs, "warps": warps,
                           "programs": progs, "stages": stages, "apart": bool(apart),
                           "permute": decode.I8_PERMUTE if perm is None else perm}
                try:
                    out = call(caches[0], **kw).float()
                    err = float((out - ref).norm() / ref.norm())
                    graph = timing.capture(lambda kw=kw: [call(c, **kw) for c in caches * 10])
                    ms = timing.time_graph_ms(graph, n=5, batches=5) / 20
                    row.update(err=round(err, 6), us=round(ms * 1e3, 2),
                               kv_gbps=round(nbytes / (ms * 1e-3) / 1e9, 1),
                               of_read=round(nbytes / (ms * 1e-3) / 1e9 / read, 4))
                except Exception as e:  # noqa: BLE001 - a configuration that fails to compile is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                doc["rows"].append(row)
                if args.out:
                    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
            caches.clear()
            torch.cuda.empty_cache()
    best: dict = {}
    for r in doc["rows"]:
        if "us" in r and r["err"] < 1e-2 and r.get("config") != "default":
            key = f"{r['shape']}:{r['kv']}:{r['context']}"
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    doc["best"] = best
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"read_bw_gbps": doc["read_bw_gbps"], "best": best}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
