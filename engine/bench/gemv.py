"""`python -m engine.bench.gemv`: the decode step's one-row products, cuBLAS (F.linear) against the Triton
GEMV (engine.kernels.decode) at each block configuration, on the shapes of the 8B models at TP1 and TP2.

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


# The fused kernels (kernel choice "fused", engine.kernels.decode) per rank of Qwen3-8B: heads, kv heads, head dim
ATTN = {"qwen3-8b-tp1": (32, 8, 128), "qwen3-8b-tp2": (16, 4, 128)}
# the fastest five of six on the first H200 run (2026-11-30), and one more
FUSED_CONFIGS = [(4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8), (16, 256, 8), (32, 256, 8)]
ATTN_CONFIGS = [  # (positions per tile, programs per kv head or None = splits_for, combine, num_warps)
    (128, None, "last", 8), (128, None, "last", 4), (64, None, "last", 4), (64, None, "last", 8),
    (256, None, "last", 8), (128, 4, "last", 8), (128, None, "kernel", 8), (32, None, "last", 4)]


def _us(fn, layers: int) -> float:
    from engine.core import timing

    graph = timing.capture(fn)
    ms = timing.time_graph_ms(graph, n=20)
    del graph
    return ms * 1e3 / layers


def fused(args, doc: dict) -> None:
    """--fused: the GEMVs with a norm / SiLU prologue against the plain GEMV of the same shape, and the
    one-kernel attention against the torch ops it replaces, each checked against float32 first."""
    import torch
    import torch.nn.functional as F

    from engine import tuning
    from engine.core.model import rms_norm, rotate_half
    from engine.kernels import decode

    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    L, eps, window = args.layers, 1e-6, args.window
    table = tuning.active()
    doc["fused"] = {}
    best: dict = {}  # what the engine should use ("fused_best"; --write-table puts it in a tuning table)
    us_kind: dict[str, float] = {}
    attn_us: dict[str, float] = {}  # config -> sum over the shape sets (inf where it failed on one)

    def rel(y, ref):
        return float((y.float().reshape(-1) - ref.reshape(-1)).norm() / ref.norm())

    for shape_set in args.shapes.split(","):
        prods = SHAPES[shape_set]
        out: dict = {"products": {}, "attention": {}}
        doc["fused"][shape_set] = out
        d = prods["qkv"][1]
        x = torch.randn(1, 1, d, **bf, generator=g)
        delta = torch.randn(1, 1, d, **bf, generator=g)
        nw = (1 + 0.1 * torch.randn(d, **bf, generator=g))
        for prod, prologue in (("qkv", decode.PROLOGUE_NORM), ("gate_up", decode.PROLOGUE_NORM),
                               ("down", decode.PROLOGUE_SILU)):
            n, k = prods[prod]
            ws = [torch.empty(n, k, **bf).normal_(0, 0.02, generator=g) for _ in range(L)]
            outs = [torch.empty(n, **bf) for _ in range(L)]
            xo = torch.empty(k, **bf)
            if prologue == decode.PROLOGUE_NORM:
                h32 = (x.float() + delta.float())
                h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * nw.float()
                eager = F.linear(rms_norm(x + delta, nw, eps), ws[0])
                xin = x.reshape(-1)

                def run(c, w=ws, o=outs):
                    return [decode.launch_prologue(prologue, xin, wi, None, oi, delta.reshape(-1), nw, eps, xo, c)
                            for wi, oi in zip(w, o)]
            else:
                gu = torch.randn(2 * k, **bf, generator=g)
                gt, up = gu.float().chunk(2)
                h32 = F.silu(gt) * up
                eager = F.linear((F.silu(gu[:k]) * gu[k:]).view(1, -1), ws[0])

                def run(c, w=ws, o=outs, gu=gu):
                    return [decode.launch_prologue(prologue, gu, wi, None, oi, blocks=c) for wi, oi in zip(w, o)]
            ref = ws[0].float() @ h32.reshape(-1)
            e_eager = rel(eager, ref)
            tol = max(1.5 * e_eager, 1e-3)
            nbytes = n * k * 2
            row = {"n": n, "k": k, "prologue": decode.PROLOGUE_NAMES[prologue], "eager_rel_err": round(e_eager, 6)}
            hin = torch.randn(k, **bf, generator=g)
            us = _us(lambda: [decode.launch(hin, wi, None, oi) for wi, oi in zip(ws, outs)], L)
            row["plain_gemv"] = {"us": round(us, 3), "gbps": round(nbytes / (us * 1e-6) / 1e9, 1),
                                 "blocks": list(table.gemv.get((n, k), table.gemv_default))}
            row["configs"] = {}
            for cfg in FUSED_CONFIGS:
                name = "x".join(map(str, cfg))
                try:
                    e = rel(run(cfg)[0], ref)
                    if not e <= tol:
                        row["configs"][name] = {"rel_err": round(e, 6), "status": f"error {e:.3g} > {tol:.3g}"}
                        continue
                    us = _us(lambda c=cfg: run(c), L)
                    row["configs"][name] = {"rel_err": round(e, 6), "us": round(us, 3),
                                            "gbps": round(nbytes / (us * 1e-6) / 1e9, 1)}
                except Exception as ex:  # noqa: BLE001 - a config that fails to build is a result
                    row["configs"][name] = {"status": f"{type(ex).__name__}: {str(ex)[:200]}"}
            timed = {c: v for c, v in row["configs"].items() if "us" in v}
            if timed:
                row["best"] = min(timed, key=lambda c: timed[c]["us"])
                row["extra_us_vs_plain"] = round(timed[row["best"]]["us"] - row["plain_gemv"]["us"], 3)
                best["{}:{}x{}".format(row["prologue"], n, k)] = [int(v) for v in row["best"].split("x")]
                us_kind[row["prologue"]] = us_kind.get(row["prologue"], 0.0) + timed[row["best"]]["us"]
            out["products"][prod] = row
            print(f"fused {shape_set} {prod}: {json.dumps(row)}", file=sys.stderr, flush=True)
            ws.clear()
            outs.clear()
            torch.cuda.empty_cache()
        # the attention: L layers' caches, the window full (pos = window - 1)
        nh, nkv, hd = ATTN[shape_set]
        qkv = torch.randn((nh + 2 * nkv) * hd, **bf, generator=g)
        qn, kn = (1 + 0.1 * torch.randn(hd, **bf, generator=g)), (1 + 0.1 * torch.randn(hd, **bf, generator=g))
        kcs = [torch.randn(1, nkv, window, hd, **bf, generator=g) for _ in range(L)]
        vcs = [torch.randn(1, nkv, window, hd, **bf, generator=g) for _ in range(L)]
        pos = torch.tensor([window - 1], device=dev)
        inv = 1.0 / (1e6 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
        emb = torch.cat([(window - 1) * inv] * 2)
        cos, sin = emb.cos().to(torch.bfloat16)[None], emb.sin().to(torch.bfloat16)[None]
        mask = torch.zeros(1, 1, 1, window, device=dev)

        def torch_attn(kc, vc, dt=torch.bfloat16):
            q, k, v = qkv.to(dt).split([nh * hd, nkv * hd, nkv * hd])
            q, k = rms_norm(q.view(1, nh, hd), qn.to(dt), eps), rms_norm(k.view(1, nkv, hd), kn.to(dt), eps)
            c, s_ = cos.to(dt), sin.to(dt)
            q, k = q * c + rotate_half(q) * s_, k * c + rotate_half(k) * s_
            kc.index_copy_(2, pos, k.view(1, nkv, 1, hd))
            vc.index_copy_(2, pos, v.view(1, nkv, 1, hd))
            s = torch.matmul(q.view(1, nkv, nh // nkv, hd), kc.transpose(-1, -2)).float() / hd ** 0.5 + mask
            return torch.matmul(torch.softmax(s, -1).to(dt), vc).reshape(-1)

        ref = torch_attn(kcs[0].float(), vcs[0].float(), torch.float32)
        e_eager = rel(torch_attn(kcs[0].clone(), vcs[0].clone()), ref)
        tol = max(1.5 * e_eager, 1e-3)
        kv_bytes = 2 * nkv * window * hd * 2
        us = _us(lambda: [torch_attn(kc, vc) for kc, vc in zip(kcs, vcs)], L)
        out["attention"] = {"heads": nh, "kv_heads": nkv, "head_dim": hd, "window": window, "kv_bytes": kv_bytes,
                            "eager_rel_err": round(e_eager, 6),
                            "torch_ops": {"us": round(us, 3), "gbps": round(kv_bytes / (us * 1e-6) / 1e9, 1)},
                            "configs": {}}
        for bs, splits, comb, warps in ATTN_CONFIGS:
            name = f"{bs}x{splits or 'auto'}x{comb}x{warps}"
            kw = dict(n_heads=nh, n_kv=nkv, hd=hd, eps=eps, window=window, combine=comb, splits=splits, block_s=bs,
                      num_warps=warps)
            try:
                o = decode.decode_attention(qkv, cos, sin, pos, qn, kn, kcs[0], vcs[0], **kw)
                e = rel(o, ref)
                again = decode.decode_attention(qkv, cos, sin, pos, qn, kn, kcs[0], vcs[0], **kw)
                row = {"rel_err": round(e, 6), "bit_identical_rerun": bool(torch.equal(o, again))}
                if not e <= tol:
                    out["attention"]["configs"][name] = {**row, "status": f"error {e:.3g} > {tol:.3g}"}
                    continue
                us = _us(lambda kw=kw: [decode.decode_attention(qkv, cos, sin, pos, qn, kn, kc, vc, **kw)
                                        for kc, vc in zip(kcs, vcs)], L)
                out["attention"]["configs"][name] = {**row, "us": round(us, 3),
                                                     "gbps": round(kv_bytes / (us * 1e-6) / 1e9, 1)}
            except Exception as ex:  # noqa: BLE001
                out["attention"]["configs"][name] = {"status": f"{type(ex).__name__}: {str(ex)[:200]}"}
        timed = {c: v for c, v in out["attention"]["configs"].items() if "us" in v}
        if timed:
            out["attention"]["best"] = min(timed, key=lambda c: timed[c]["us"])
        for c, v in out["attention"]["configs"].items():  # a config must pass on every shape to be chosen
            attn_us[c] = attn_us.get(c, 0.0) + v.get("us", float("inf"))
        print(f"fused {shape_set} attention: {json.dumps(out['attention'])}", file=sys.stderr, flush=True)
        kcs.clear()
        vcs.clear()
        torch.cuda.empty_cache()
    ok = {c: v for c, v in attn_us.items() if "kernel" not in c and v < float("inf")}
    if ok:
        bs, splits, _, warps = min(ok, key=ok.get).split("x")
        best["attention"] = [int(bs), int(warps), 0 if splits == "auto" else int(splits)]
    doc["fused_best"] = best
    doc["fused_us_by_prologue"] = {k: round(v, 3) for k, v in us_kind.items()}


def _write(doc: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as fh:
            json.dump(doc, fh, indent=1)


def _finish(doc: dict, out: str | None, t0: float, summary: str, table: str | None = None) -> int:
    """The run's wall time into doc, doc written to --out, its ``summary`` section printed; with ``table`` (a
    tuning table file, engine.tuning) the winners merged into it: ``gemv`` from the plain sweep, ``prologue`` and
    ``attention`` from --fused."""
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    _write(doc, out)
    if table and doc[summary]:
        from engine import tuning

        found = dict(doc[summary])
        attention = found.pop("attention", None)
        extra = {"attention": attention} if attention is not None else {}
        tuning.write(table, "prologue" if summary == "fused_best" else "gemv", found,
                     measured_on=doc.get("device"), **extra)
    print(json.dumps(doc[summary]))
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.gemv", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all; "
                                                  f"--fused: {', '.join(ATTN)})")
    p.add_argument("--fused", action="store_true",
                   help="time the fused kernels (norm / SiLU prologue GEMVs, the one-kernel attention) instead")
    p.add_argument("--window", type=int, default=1024, help="--fused: the attention's window (full: pos = window - 1)")
    p.add_argument("--out", default=None)
    p.add_argument("--write-table", default=None, metavar="FILE",
                   help="merge the winners into this tuning table (e.g. engine/tuning/hopper.json; made from the "
                        "default family's when it does not exist)")
    args = p.parse_args(argv)
    args.device = "cuda:0"
    args.shapes = args.shapes or ",".join(ATTN if args.fused else SHAPES)

    import torch
    import torch.nn.functional as F

    from engine import tuning
    from engine.core import timing
    from engine.kernels import decode
    from profiles.document import utc_now

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    torch.set_grad_enabled(False)
    doc: dict = {"kind": "engine_bench_gemv", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev),
                 "torch": torch.__version__, "layers": args.layers, "dtype": "bfloat16", "method": __doc__.strip(),
                 "read_bw_gbps": round(timing.read_bandwidth_gbps(dev), 1), "shapes": {}, "best": {}}
    t0 = time.perf_counter()
    if args.fused:
        doc["kind"] = "engine_bench_fused"
        fused(args, doc)
        return _finish(doc, args.out, t0, "fused_best", args.write_table)
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

            row = {"n": n, "k": k, "cublas": {"rel_err": round(cub_err, 6)}}
            us = _us(lambda: [F.linear(x, w) for w in ws], args.layers)
            row["cublas"].update(us=round(us, 3), gbps=round(nbytes / args.layers / (us * 1e-6) / 1e9, 1))
            row["triton"] = {}
            xv = x.view(-1)
            for cfg in tuning.active().gemv_configs:
                name = "x".join(map(str, cfg))
                try:
                    e = err(decode.launch(xv, ws[0], None, outs[0], cfg))
                    if e > tol:
                        row["triton"][name] = {"rel_err": round(e, 6), "status": f"error {e:.3g} > {tol:.3g}"}
                        continue
                    us = _us(lambda c=cfg: [decode.launch(xv, w, None, o, c) for w, o in zip(ws, outs)], args.layers)
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
            _write(doc, args.out)
    return _finish(doc, args.out, t0, "best", args.write_table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
