"""`python -m engine.bench.gemv`: the decode step's one-row products, cuBLAS (F.linear) against the Triton
GEMV (engine.core.gemv) at each block configuration, on the shapes of the 8B models at TP1 and TP2.

Per product shape, L distinct random weight matrices (one per layer, so nothing stays in the 60 MB L2)
are multiplied in one CUDA graph; time = median of 5 batches of 20 replays / L. Each configuration's
output is first checked against the float32 product of the same weights (relative L2 error, beside
cuBLAS's own), and a configuration whose error exceeds 1.5x cuBLAS's (floor 1e-3) is not timed.
GB/s = weight bytes / time; the card's read bandwidth is measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SHAPES = {  # name -> {product: (N, K)}, bf16 weights, per rank
    "qwen3-8b-tp1": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "qwen3-8b-tp2": {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (12288, 4096), "down": (4096, 6144)},
    "llama-3.1-8b-tp1": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
                         "down": (4096, 14336)},
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.gemv", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from engine.core import gemv, timing
    from profiles.document import utc_now

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    torch.set_grad_enabled(False)
    doc: dict = {"kind": "engine_bench_gemv", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev),
                 "torch": torch.__version__, "layers": args.layers, "dtype": "bfloat16", "method": __doc__.strip(),
                 "read_bw_gbps": round(timing.read_bandwidth_gbps(dev), 1), "shapes": {}, "best": {}}
    t0 = time.perf_counter()
    g = torch.Generator(device=dev).manual_seed(0)
    for shape_set in args.shapes.split(","):
        doc["shapes"][shape_set] = {}
        for prod, (n, k) in SHAPES[shape_set].items():
            ws = [torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
                  for _ in range(args.layers)]
            x = torch.randn(1, k, device=dev, dtype=torch.bfloat16, generator=g)
            ref = (ws[0].float() @ x.float().view(-1))
            nbytes = n * k * 2 * args.layers

            def err(y):
                return float((y.float().view(-1) - ref).norm() / ref.norm())

            cub_err = err(F.linear(x, ws[0]))
            tol = max(1.5 * cub_err, 1e-3)
            outs = [torch.empty(n, device=dev, dtype=torch.bfloat16) for _ in range(args.layers)]

            def us_of(fn):
                graph = timing.capture(fn)
                ms = timing.time_graph_ms(graph, n=20)
                del graph
                return ms * 1e3 / args.layers

            row = {"n": n, "k": k, "cublas": {"rel_err": round(cub_err, 6)}}
            us = us_of(lambda: [F.linear(x, w) for w in ws])
            row["cublas"].update(us=round(us, 3), gbps=round(nbytes / args.layers / (us * 1e-6) / 1e9, 1))
            row["triton"] = {}
            xv = x.view(-1)
            for cfg in gemv.CONFIGS:
                name = "x".join(map(str, cfg))
                try:
                    e = err(gemv.launch(xv, ws[0], None, outs[0], cfg))
                    if e > tol:
                        row["triton"][name] = {"rel_err": round(e, 6), "status": f"error {e:.3g} > {tol:.3g}"}
                        continue
                    us = us_of(lambda c=cfg: [gemv.launch(xv, w, None, o, c) for w, o in zip(ws, outs)])
                    row["triton"][name] = {"rel_err": round(e, 6), "us": round(us, 3),
                                           "gbps": round(nbytes / args.layers / (us * 1e-6) / 1e9, 1)}
                except Exception as ex:  # noqa: BLE001 - a config that fails to build is a result
                    row["triton"][name] = {"status": f"{type(ex).__name__}: {str(ex)[:200]}"}
            timed = {c: v for c, v in row["triton"].items() if "us" in v}
            if timed:
                best = min(timed, key=lambda c: timed[c]["us"])
                row["best"] = best
                row["speedup_vs_cublas"] = round(row["cublas"]["us"] / timed[best]["us"], 3)
                doc["best"][f"{n}x{k}"] = [int(v) for v in best.split("x")]
            doc["shapes"][shape_set][prod] = row
            print(f"{shape_set} {prod}: {json.dumps(row)}", file=sys.stderr, flush=True)
            ws.clear()
            outs.clear()
            torch.cuda.empty_cache()
            if args.out:
                with open(args.out, "w") as fh:
                    json.dump(doc, fh, indent=1)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)
    print(json.dumps(doc["best"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
