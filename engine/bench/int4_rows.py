"""`python -m engine.bench.int4_rows`: the batched int4 GEMV at M = 1..16 rows against the one-row GEMV, on the 27B.

The batched GEMV (engine.kernels.gemv_int4.launch_rows: M rows of x through one packed matrix, each weight word read
once) against the one-row int4 GEMV (gemv_int4.launch, what decode_step runs) and against the path it replaces (the
matrix dequantised to the activations' dtype, then F.linear), on the matrices of the 27B hybrid shape (--config,
engine/data/qwen3.5-27b.config.json) at TP1, printed as a table and written as JSON with --out.

The matrices, as the engine holds them (random words, zero points and scales, group --group, in tiles of
gemv_int4.TILE_ROWS rows as loading leaves them on a GPU):
  wqkv   [2 heads hd (q and its output gate) + 2 kv hd, hidden]   a full-attention layer's q / gate / k / v
  wo     [hidden, heads hd]
  w_in   [2 nk dk + nv dv + nv dv + 2 nv, hidden]                 a Gated DeltaNet layer's in_proj_qkv | z | b | a
  w_out  [hidden, nv dv]
  w13    [2 intermediate, hidden]                                  gate / up
  w2     [hidden, intermediate]                                    down
What each number is: per matrix, L distinct copies (together at least 512 MiB, so none is read from the 50 MiB L2 of
an H100) multiplied one after another in one CUDA graph, the graph replayed between CUDA events after warm-up, the
median over batches of replays (engine.core.timing: time_graph_ms), divided by L: us per product. bytes = packed
words + zero points + scales of one matrix; gbps = bytes / us; fraction_of_read = gbps / the card's read bandwidth
(timing.read_bandwidth_gbps); fraction_of_m1 = gbps / the one-row GEMV's gbps on the same matrix. The one-row GEMV
runs its blocks from the tuning table (its row kernel included, as in a decode step); the batched one its default
blocks (gemv_int4._rows_default_blocks, not measured before this bench) at M = 1, 2, 4, 8, 16, and the --configs
at --sweep-rows. Every timed configuration is first checked against dequantise-then-matmul in float32 (relative
L2 error < 1e-2, else not timed). summary: per M, bytes / sum of us over the matrices (each matrix once), against
the one-row GEMV's; "m8_vs_m1" is the issue's criterion (the batched GEMV at M = 8 reads weights at >= the
fraction of the read bandwidth the M = 1 kernel reaches: >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROWS = (1, 2, 4, 8, 16)
L2_SPAN_BYTES = 512 * 2 ** 20  # at least this many weight bytes per graph, so no matrix is read from L2
# batched-GEMV blocks (BLOCK_N, BLOCK_K, num_warps, split, form: 1 = tl.dot, 0 = FMA, stages: 2 = the next tile's
# loads before this tile's arithmetic, 1 = not) also timed at --sweep-rows (each a Triton compile on a fresh machine:
# few, so the whole bench stays well inside two minutes)
CONFIGS = [(64, 128, 4, 1, 1, 1), (64, 128, 4, 1, 1, 2), (128, 128, 8, 1, 1, 2), (32, 128, 4, 1, 1, 2),
           (64, 128, 4, 4, 1, 2), (16, 128, 4, 4, 0, 2), (32, 128, 4, 1, 0, 2)]


def matrices(cfg: dict) -> dict[str, tuple[int, int]]:
    """(N, K) of each layer matrix of a hybrid (Qwen3.5) config at TP1, as the engine stacks them."""
    d, ff, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    return {"wqkv": (2 * heads * hd + 2 * kv * hd, d), "wo": (d, heads * hd),
            "w_in": (2 * nk * dk + 2 * nv * dv + 2 * nv, d), "w_out": (d, nv * dv),
            "w13": (2 * ff, d), "w2": (d, ff)}


def _configs(text: str) -> list[tuple[int, ...]]:
    try:
        out = [tuple(int(v) for v in part.split(",")) for part in text.split(";") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--configs: {text!r} is not ';'-separated BN,BK,warps,split,form[,stages]") from None
    if any(len(c) not in (5, 6) or c[4] not in (0, 1) or c[5:] not in ((), (1,), (2,)) for c in out):
        raise argparse.ArgumentTypeError("--configs: each configuration has five or six numbers "
                                         "(BN,BK,warps,split,form[,stages]), form 0 (FMA) or 1 (tl.dot), stages 1 or 2")
    return out


def _rows(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated row counts") from None
    if any(not 1 <= m <= 16 for m in out):
        raise argparse.ArgumentTypeError("row counts are 1..16 (gemv_int4.ROWS_MAX)")
    return out


def _packed(n: int, k: int, group: int, dev, g):
    import torch

    from engine.core import quant
    from engine.kernels import gemv_int4

    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, device=dev, generator=g)
    zeros = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // group, n // 8), dtype=torch.int32, device=dev, generator=g)
    scales = (0.001 + 0.002 * torch.rand(k // group, n, device=dev, generator=g)).half()
    return gemv_int4.held(quant.PackedLinear(words, zeros, scales, None, group, 1, f"gptq-int4-g{group}"), dev)


def _entry(nbytes: int, us: float, read: float, m1_gbps: float | None) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    out = {"us": round(us, 3), "gbps": round(gbps, 1), "fraction_of_read": round(gbps / read, 4)}
    if m1_gbps:
        out["fraction_of_m1"] = round(gbps / m1_gbps, 4)
    return out


def bench_matrix(args, name: str, n: int, k: int, dev, g, read: float) -> dict:
    import torch
    import torch.nn.functional as F

    from engine.bench.gemv import _us
    from engine.kernels import decode, gemv_int4

    act = getattr(torch, args.dtype)
    ws = [_packed(n, k, args.group, dev, g)]
    count = max(2, min(64, -(-L2_SPAN_BYTES // ws[0].nbytes)))
    ws += [_packed(n, k, args.group, dev, g) for _ in range(count - 1)]
    one = ws[0]
    x16 = torch.randn(16, k, device=dev, generator=g).to(act)
    ref16 = F.linear(x16.float(), one.dequantise(torch.float32))
    outs1 = [torch.empty(n, device=dev, dtype=act) for _ in ws]
    row = {"n": n, "k": k, "bytes": one.nbytes, "matrices": count, "tile_rows": one.tile_rows, "rows": {}}

    def rel(y, ref) -> float:
        return float((y.float() - ref).norm() / ref.norm())

    gemv_int4.launch(decode.PROLOGUE_PLAIN, x16[0], one, None, outs1[0])
    err1 = rel(outs1[0], ref16[0])
    us1 = _us(lambda: [gemv_int4.launch(decode.PROLOGUE_PLAIN, x16[0], w, None, o) for w, o in zip(ws, outs1)], count)
    row["m1_gemv"] = {**_entry(one.nbytes, us1, read, None), "rel_err": round(err1, 6)}
    m1_gbps = row["m1_gemv"]["gbps"]

    def timed(m: int, blocks) -> dict:
        x = x16[:m]
        outs = [torch.empty(m, n, device=dev, dtype=act) for _ in ws]
        try:
            gemv_int4.launch_rows(x, one, None, outs[0], blocks)
            err = rel(outs[0], ref16[:m])
            if err > 1e-2:
                return {"rel_err": round(err, 6), "skipped": "error over 1e-2"}
            us = _us(lambda: [gemv_int4.launch_rows(x, w, None, o, blocks) for w, o in zip(ws, outs)], count)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile or launch is reported
            return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        return {**_entry(one.nbytes, us, read, m1_gbps), "rel_err": round(err, 6)}

    for m in args.rows:
        blocks = gemv_int4._rows_default_blocks(n, k, m, act, dev)
        row["rows"][str(m)] = {"blocks": list(blocks), **timed(m, blocks)}
        if m in args.sweep_rows:
            sweep = {"x".join(map(str, c)): timed(m, c) for c in args.configs}
            row["rows"][str(m)]["sweep"] = sweep
            ok = {c: v for c, v in sweep.items() if "us" in v}
            if ok:
                best = min(ok, key=lambda c: ok[c]["us"])
                row["rows"][str(m)]["best_swept"] = {"blocks": best, **ok[best]}
    m = args.dequant_rows  # the path the batched GEMV replaces: dequantise to act, then cuBLAS
    x = x16[:m]
    deq_us = _us(lambda: [F.linear(x, gemv_int4.dequantise(w, act)) for w in ws], count)
    row["dequant_linear"] = {"rows": m, **_entry(one.nbytes, deq_us, read, m1_gbps)}
    return row


def summary(doc: dict, read: float) -> dict:
    mats = [r for r in doc["matrices"].values() if "m1_gemv" in r]
    total = sum(r["bytes"] for r in mats)
    m1_us = sum(r["m1_gemv"]["us"] for r in mats)
    m1_frac = total / (m1_us * 1e-6) / 1e9 / read
    out = {"m1_fraction_of_read": round(m1_frac, 4), "rows": {}}
    for m in sorted({int(k) for r in mats for k in r["rows"]}):
        have = [r for r in mats if "us" in r["rows"].get(str(m), {})]
        if len(have) != len(mats):
            out["rows"][str(m)] = {"note": "not every matrix was timed"}
            continue
        us = sum(r["rows"][str(m)]["us"] for r in have)
        frac = total / (us * 1e-6) / 1e9 / read
        out["rows"][str(m)] = {"us": round(us, 2), "fraction_of_read": round(frac, 4),
                               "vs_m1": round(frac / m1_frac, 4)}
    if "8" in out["rows"] and "vs_m1" in out["rows"]["8"]:
        out["m8_vs_m1"] = out["rows"]["8"]["vs_m1"]
    return out


def table(doc: dict) -> str:
    lines = [f"{doc['device']}  read {doc['read_bw_gbps']} GB/s  {doc['dtype']}  group {doc['group_size']}"]
    for name, r in doc["matrices"].items():
        m1 = r["m1_gemv"]
        lines.append(f"{name} {r['n']}x{r['k']} ({r['bytes'] / 2 ** 20:.1f} MiB): M=1 GEMV {m1['us']:.1f} us "
                     f"{m1['gbps']:.0f} GB/s ({m1['fraction_of_read']:.2f} of read)")
        for m, e in r["rows"].items():
            if "us" not in e:
                lines.append(f"  rows M={m:>2}: {e.get('error') or e.get('skipped')}")
                continue
            best = e.get("best_swept")
            lines.append(f"  rows M={m:>2}: {e['us']:8.1f} us {e['gbps']:6.0f} GB/s  {e['fraction_of_m1']:.2f} x M=1"
                         + (f"  (best swept {best['blocks']}: {best['us']:.1f} us, {best['fraction_of_m1']:.2f} x M=1)"
                            if best else ""))
        d = r["dequant_linear"]
        lines.append(f"  dequantise + F.linear M={d['rows']}: {d['us']:8.1f} us {d['gbps']:6.0f} GB/s  "
                     f"{d['fraction_of_m1']:.2f} x M=1")
    for m, s in doc["summary"]["rows"].items():
        if "us" in s:
            lines.append(f"all matrices M={m:>2}: {s['fraction_of_read']:.3f} of read, {s['vs_m1']:.3f} x M=1's "
                         f"{doc['summary']['m1_fraction_of_read']:.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.bench.int4_rows", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="engine/data/qwen3.5-27b.config.json", help="the model shape (hybrid)")
    p.add_argument("--matrices", default=None, help="comma-separated subset of wqkv, wo, w_in, w_out, w13, w2 "
                                                    "(default: all)")
    p.add_argument("--group", type=int, default=128, choices=(32, 64, 128), help="group size (default: 128)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="activations (bfloat16)")
    p.add_argument("--rows", default=list(ROWS), type=_rows, help="batch rows to time (default: 1,2,4,8,16)")
    p.add_argument("--sweep-rows", default=[8, 16], type=_rows,
                   help="rows at which --configs are timed too (default: 8,16)")
    p.add_argument("--configs", default=CONFIGS, type=_configs,
                   help="batched blocks to sweep, ';'-separated BN,BK,warps,split,form (default: CONFIGS; '' for "
                        "none)")
    p.add_argument("--dequant-rows", type=int, default=8, help="rows of the dequantise + F.linear path (default: 8)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    shapes = matrices(json.loads(Path(args.config).read_text()))
    names = args.matrices.split(",") if args.matrices else list(shapes)
    bad = [s for s in names if s not in shapes]
    if bad:
        print(f"Error: unknown matrices {bad}; choose from {', '.join(shapes)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("Error: this bench needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 4
    try:
        import triton
    except ImportError:
        print("Error: the int4 kernels need Triton (pip install triton)", file=sys.stderr)
        return 4
    from engine.core import timing
    from profiles.document import utc_now

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    read = round(timing.read_bandwidth_gbps(dev), 1)
    doc: dict = {"kind": "engine_bench_int4_rows", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev),
                 "capability": list(torch.cuda.get_device_capability(dev)), "torch": torch.__version__,
                 "triton": triton.__version__, "config": args.config, "group_size": args.group, "dtype": args.dtype,
                 "method": __doc__.strip(), "read_bw_gbps": read, "matrices": {}}
    g = torch.Generator(device=dev).manual_seed(0)
    for name in names:
        n, k = shapes[name]
        doc["matrices"][name] = bench_matrix(args, name, n, k, dev, g, read)
        torch.cuda.empty_cache()
    doc["summary"] = summary(doc, read)
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    print(table(doc))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
