"""`python -m engine bench`: decode speed of a real-shape, random-weight model at batch 1 (TP1), prefill
rate, and allreduce latency per path, printed as one JSON document.

What each number is (every time is a median over CUDA-graph replays or repeats):
  read_bw_gbps          sum over a 4 GiB float32 buffer: the card's measured read bandwidth
  gemv.weight_gbps      every weight matrix once as a batch-1 matrix-vector product, in one graph:
                        weight bytes / time -> the engine's weight_bw_fraction
  decode[ctx]           one whole decode step with attention over ``window`` cached positions, the
                        service's own (engine.core.runner.Decoder's CUDA graph for that window, replayed, with
                        the kernels the service chooses on this card unless --kernels says otherwise): tok/s,
                        and (weight bytes + K/V bytes read + linear-attention state read and written) / time
                        against the floor: those bytes at read_bw_gbps
  fit                   step time = intercept + slope x K/V bytes, least squares over the contexts:
                        kv_bw_fraction = 1 / slope / read_bw; round_overhead_ms = intercept - gemv time
  prefill[tokens]       a prompt of that many tokens in --prefill-chunk chunks (as the service prefills):
                        (2 x matrix parameters x tokens + causal attention FLOPs) / time, against
                        --peak-tflops when given
  allreduce[path][size] two processes on this host, median microseconds per allreduce
The weights are random (shape and bytes are what decode speed depends on), made on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from engine import DATA_DIR, dtype_rule
from engine.core import timing

DATA = DATA_DIR
SIZES = (4 << 10, 8 << 10, 16 << 10, 40 << 10, 64 << 10, 256 << 10, 1 << 20)


def emit_json(doc: dict, out: str | None) -> None:
    if out:
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")


def read_bandwidth_gbps(device) -> float:
    """The card's measured read bandwidth: a sum over a 4 GiB float32 buffer (engine.core.timing)."""
    return timing.read_bandwidth_gbps(device, 4 << 30)


def x_bytes_over_ms(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def gemv_only(model) -> dict:
    """Every weight matrix of every layer kind once as a batch-1 product (cuBLAS), in one graph."""
    import torch
    import torch.nn.functional as F

    dev, dt = model.device, model.dtype
    mats = [t for layer in model.layers for t in layer.weights().values() if t.dim() == 2 and t.shape[1] >= 64]
    xs = {k: torch.randn(1, k, device=dev, dtype=dt) for k in {t.shape[1] for t in mats + [model.head]}}

    def run():
        for w in mats:
            F.linear(xs[w.shape[1]], w)
        F.linear(xs[model.head.shape[1]], model.head)

    ms = timing.time_graph_ms(timing.capture(run))
    nbytes = (sum(t.numel() for t in mats) + model.head.numel()) * model.head.element_size()
    return {"ms": round(ms, 4), "weight_bytes": nbytes, "weight_gbps": round(x_bytes_over_ms(nbytes, ms), 1)}


def state_bytes_per_step(model) -> int:
    """Linear-attention state a decode step moves: the float32 recurrent state read and written, the conv
    ring read (the K/V cache is counted per position apart)."""
    lin = [la for la in model.layers if la.kind == "linear_attention"]
    return sum(2 * la.rec_state.numel() * 4 + la.conv_ring.numel() * la.conv_ring.element_size() for la in lin)


def profile_graph(graph, replays: int = 10, top: int = 30) -> dict:
    """Where one replay of ``graph`` spends its time, from torch.profiler over ``replays`` replays: kernels per
    replay, the GPU's busy microseconds (the sum of kernel times), the idle microseconds between consecutive
    kernels, and the ``top`` kernel names by time, each with its launches and microseconds per replay."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    agg: dict[str, list] = {}
    for e in ev:
        a = agg.setdefault(e.name[:90], [0, 0.0])
        a[0] += 1
        a[1] += e.time_range.end - e.time_range.start
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev)
    idle = sum(max(0, b[0] - a[1]) for a, b in zip(spans, spans[1:]))
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    return {"replays": replays, "kernels_per_replay": round(len(ev) / replays, 1),
            "busy_us": round(sum(v[1] for _, v in rows) / replays, 1), "idle_us": round(idle / replays, 1),
            "top": [{"kernel": k, "launches": round(n / replays, 1), "us": round(t / replays, 1)}
                    for k, (n, t) in rows[:top]]}


def decode(model, contexts: list[int], kernels: str | None = None, read_gbps: float | None = None,
           exchange: str | None = None, profile: bool = False) -> dict:
    """The service's own decode step, as the ranks replay it: engine.core.runner.Decoder captures one graph
    per window (the context rounded up to 256) and this times exactly those replays. ``kernels``: None = what
    the service chooses on this card (engine.core.decode_mode.kernel_choice); ``exchange``: the TP2 exchange mode
    (engine.core.decode_mode.EXCHANGES; None = the service's). ``profile``: each context's row also carries
    profile_graph's breakdown of its replay (taken after the timing, so it does not disturb it)."""
    import torch

    from engine.core.runner import Decoder

    out = {}
    kv_per_pos = model.state_bytes()["kv_cache"] // model.max_context  # as the cache holds them (int8 or not)
    w = model.weight_bytes()
    st = state_bytes_per_step(model)
    windows = {ctx: -(-ctx // 256) * 256 for ctx in contexts}
    dec = Decoder(model, graphs=True, kernels=kernels, exchange=exchange, bucket_list=sorted(set(windows.values())))
    dec.capture()
    for ctx, window in windows.items():
        graph, _, pos = dec.graph_for(window)
        pos.fill_(ctx - 1)
        ms = timing.time_graph_ms(graph)
        kv = kv_per_pos * ctx  # what the step reads: positions past pos are masked, not read
        row = {"window": window, "ms": round(ms, 4), "tok_s": round(1000 / ms, 2),
               "weight_gbps": round(x_bytes_over_ms(w, ms), 1),
               "total_gbps": round(x_bytes_over_ms(w + kv + st, ms), 1), "kv_bytes": kv, "state_bytes": st,
               "kernels": dec.kernels}
        if read_gbps:
            floor = (w + kv + st) / (read_gbps * 1e9) * 1e3
            row.update(floor_ms=round(floor, 4), of_floor=round(floor / ms, 4))
        if profile:
            row["profile"] = profile_graph(graph)
        out[str(ctx)] = row
        if dec.info.get("exchange"):
            out[str(ctx)]["exchange"] = dec.info["exchange"]
    if hasattr(getattr(model.comm, "path", None), "check"):
        model.comm.path.check()
    del dec
    torch.cuda.empty_cache()
    return out


def fit(dec: dict, gemv_ms: float, read_gbps: float) -> dict:
    """Least-squares line through (K/V bytes, step ms): slope -> KV bandwidth, intercept -> fixed part."""
    pts = [(v["kv_bytes"], v["ms"]) for v in dec.values()]
    if len(pts) < 2:
        return {"kv_bw_fraction": None, "round_overhead_ms": None, "reason": "needs two or more contexts"}
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx  # ms per byte
    intercept = my - slope * mx
    if slope <= 0:
        return {"slope_ms_per_gb": round(slope * 1e9, 4), "intercept_ms": round(intercept, 4), "kv_gbps": None,
                "kv_bw_fraction": None, "round_overhead_ms": None,
                "reason": "step time did not grow with context: noise exceeds the K/V cost, no line to read"}
    kv_gbps = 1 / (slope * 1e-3) / 1e9
    return {"slope_ms_per_gb": round(slope * 1e9, 4), "intercept_ms": round(intercept, 4),
            "kv_gbps": round(kv_gbps, 1), "kv_bw_fraction": round(kv_gbps / read_gbps, 4),
            "round_overhead_ms": round(intercept - gemv_ms, 4)}


def prefill(model, tokens: int = 2048, chunk: int = 2048, repeats: int = 3) -> dict:
    """A prompt of ``tokens`` in chunks of ``chunk`` (Model.forward per chunk, as the ranks prefill)."""
    import torch

    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=model.device)
    ts = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for start in range(0, tokens, chunk):
            model.forward(ids[:, start:start + chunk], start)
        torch.cuda.synchronize()
        if i:
            ts.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(ts)
    matrix_params = cfg.param_count() - cfg.vocab_size * cfg.hidden_size  # minus the embedding lookup table
    attn = cfg.n_full * 2 * 2 * cfg.q_size * tokens * (tokens + 1) / 2  # QK^T and PV, causal half
    flops = 2 * matrix_params * tokens + attn
    return {"tokens": tokens, "chunk": chunk, "ms": round(ms, 2), "tok_s": round(tokens / (ms * 1e-3), 1),
            "tflops": round(flops / (ms * 1e-3) / 1e12, 1)}


def _allreduce_worker(rank: int, rdv: str, device: str, dtype: str, paths: list[str], out: str, iters: int):
    import torch
    import torch.distributed as dist

    from engine.allreduce.base import PathError
    from engine.allreduce.dist import init_control
    from engine.allreduce.select import build, same_device, selftest

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = init_control(rdv, 0, rank, 2, 30.0)
    shared = same_device(dev)
    dt = getattr(torch, dtype)
    res: dict = {"shared_device": shared}
    for name in paths:
        try:
            p = build(name, rank=rank, device=dev, timeout_s=30.0, abort=None, rendezvous_dir=rdv, generation=0,
                      store=store, shared_device=shared)
            why = selftest(p, rank, dev, dt)
        except (PathError, RuntimeError) as e:
            p, why = None, str(e)
        both = [None, None]
        dist.all_gather_object(both, why)
        if any(both):
            res[name] = {"unavailable": "; ".join(w for w in both if w)}
            continue
        row = {}
        for size in SIZES:
            x = torch.ones(size // dt.itemsize, dtype=dt, device=dev)
            for _ in range(10):
                p.allreduce_sum(x)
            ts = []
            for _ in range(iters):
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                p.allreduce_sum(x)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                ts.append((time.perf_counter() - t0) * 1e6)
            row[f"{size // 1024}k"] = round(statistics.median(ts), 2)
        res[name] = row
        p.close()
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def allreduce(device: str, dtype: str, iters: int) -> dict:
    import multiprocessing as mp
    import tempfile

    paths = ["device_mailbox", "nccl", "host_mailbox", "gloo"] if device.startswith("cuda") else ["host_mailbox", "gloo"]
    with tempfile.TemporaryDirectory(prefix="v100plan-bench-") as d:
        out = os.path.join(d, "allreduce.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_allreduce_worker, args=(r, d, device, dtype, paths, out, iters)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
            if p.is_alive():
                p.kill()
        if not os.path.exists(out):
            return {"unavailable": "the allreduce workers did not finish"}
        return json.loads(Path(out).read_text())


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written (it says what each number is), and every option's default."""


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine bench", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--config", default=str(DATA / "llama-3.1-8b.config.json"), help="a config.json (real shape)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    p.add_argument("--contexts", default="512,4096,16384")
    p.add_argument("--kernels", default=None, choices=("eager", "fused"),
                   help="the decode step's kernels (default: what the service chooses on this card)")
    p.add_argument("--also-eager", action="store_true", help="also time the plain (eager-block) step, for reference")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "int8"),
                   help="the K/V cache (int8: engine.core.kvquant)")
    p.add_argument("--prefill-tokens", default="2048", help="prompt lengths to prefill, comma-separated")
    p.add_argument("--prefill-chunk", type=int, default=2048, help="tokens per prefill chunk")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"))
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense fp16/bf16 tensor peak")
    p.add_argument("--peak-source", default=None, help="where --peak-tflops comes from (datasheet name)")
    p.add_argument("--profile", action="store_true",
                   help="also record where the service step's time goes per context (torch.profiler: the kernels "
                        "by time, busy and idle microseconds)")
    p.add_argument("--skip-allreduce", action="store_true")
    p.add_argument("--allreduce-device", default=None, help="device for both allreduce ranks (default --device)")
    p.add_argument("--allreduce-iters", type=int, default=200)
    p.add_argument("--out", default=None, help="also write the JSON here (rewritten after every phase)")
    args = p.parse_args(argv)

    import torch

    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        print(json.dumps({"error": "the engine benchmark needs a CUDA GPU"}))
        return 4
    dev = torch.device(args.device if ":" in args.device else "cuda:0")
    torch.cuda.set_device(dev)
    major, minor = torch.cuda.get_device_capability(dev)
    dtype = dtype_rule.resolve(args.dtype, (major, minor))
    raw = json.loads(Path(args.config).read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
        raw.pop("layer_types", None)  # rebuilt from the interval (a hybrid's full_attention_interval)
    cfg = ecfg.from_dict(raw)
    contexts = [int(c) for c in args.contexts.split(",")]
    from profiles.document import utc_now

    doc: dict = {
        "kind": "engine_bench", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev), "compute_capability": f"{major}.{minor}",
        "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": dtype, "config": Path(args.config).name,
        "model_type": cfg.model_type, "num_layers": cfg.num_layers, "parameters": cfg.param_count(),
        "peak_tflops": args.peak_tflops, "peak_source": args.peak_source,
        "method": "CUDA events; median of 5 batches of 50 graph replays; random weights made on the GPU",
    }
    torch.set_grad_enabled(False)
    doc["read_bw_gbps"] = round(read_bandwidth_gbps(dev), 1)
    emit_json(doc, args.out)
    model = Model(cfg, dtype=getattr(torch, dtype), device=dev, kv_dtype=args.kv_cache_dtype)
    weights.init_random(model)
    model.setup_cache(-(-max(contexts) // 256) * 256 + 256)
    doc["weight_bytes"] = model.weight_bytes()
    doc["kv_cache_dtype"] = args.kv_cache_dtype
    # K/V bytes per position as the cache holds them (int8: one byte per value plus a float32 scale per head)
    doc["kv_bytes_per_token"] = model.state_bytes()["kv_cache"] // model.max_context
    doc["gemv"] = gemv_only(model)
    doc["predicted_ms_at_read_bw"] = round(doc["weight_bytes"] / (doc["read_bw_gbps"] * 1e9) * 1e3, 4)
    emit_json(doc, args.out)
    doc["state_bytes_per_step"] = state_bytes_per_step(model)
    with torch.inference_mode():
        doc["decode"] = {"service_graph": decode(model, contexts, args.kernels, doc["read_bw_gbps"],
                                                 profile=args.profile)}
        doc["decode_kernels"] = doc["decode"]["service_graph"][str(contexts[0])]["kernels"]
        if args.also_eager:
            doc["decode"]["eager_graph"] = decode(model, contexts, "eager", doc["read_bw_gbps"])
    doc["fit"] = {k: fit(v, doc["gemv"]["ms"], doc["read_bw_gbps"]) for k, v in doc["decode"].items()}
    emit_json(doc, args.out)
    doc["prefill"] = {}
    for n in (int(t) for t in args.prefill_tokens.split(",") if t):  # --prefill-tokens "": none
        with torch.inference_mode():
            row = prefill(model, n, args.prefill_chunk, repeats=3 if n <= 16384 else 1)
        if args.peak_tflops:
            row["compute_fraction"] = round(row["tflops"] / args.peak_tflops, 4)
        doc["prefill"][str(n)] = row
        emit_json(doc, args.out)
    if not args.skip_allreduce:
        doc["allreduce_us"] = allreduce(args.allreduce_device or str(dev), dtype, args.allreduce_iters)
        emit_json(doc, args.out)
    del model
    torch.cuda.empty_cache()
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
