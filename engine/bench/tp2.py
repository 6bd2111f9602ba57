"""`python -m engine bench-tp2`: two processes, one GPU each: the allreduce paths, the start-up race, and
TP2 vs TP1 decode of a real-shape, random-weight model, printed as one JSON document.

What each number is (both ranks run every phase in lockstep; rank 0 writes the document):
  race                  engine/allreduce/select.py's `--allreduce auto` choice, as a rank starts it, and
                        whether it is the fastest path at 8 KB and 40 KB by this bench's own table
  allreduce[path]       per size (4 KB .. 1 MB): a bit-exact check of the sum of known data, then
                        eager_us: median of --iters single allreduces, synchronised before and after each;
                        graph_us: --graph-ops allreduces captured in one CUDA graph, median over 5 batches
                        of 20 replays / ops (only paths the GPU can run without the host: NCCL and the
                        GPU-side mailbox, engine/allreduce/graph_mailbox.py, "device_mailbox_graph")
  read_bw_gbps[rank]    sum over a 4 GiB float32 buffer on each card (engine.bench.decode)
  tp1[rank]             each card alone: the whole model (world 1): weights as batch-1 GEMVs in one
                        graph, decode step per context (graph, and eager), the engine.bench.decode fit, a prefill chunk
  tp2[path]             the engine's TP split (engine/core/model.py, world 2) over that path: decode per context,
                        in a CUDA graph where the path can be captured, and eager for every path
  decode_graph          the service's own step: engine.core.runner.Decoder's graph for the context's window,
                        replayed (--kernels: the blocks the service would choose on this card)
  served                the service's loop in-process (runner.run + the rank's lockstep exchange):
                        ms per token from a long and a short generation (--served)
  summary               the served-speed ratios, each from this run: served vs bench step, TP2 vs TP1,
                        TP1 step vs the floor at the measured read bandwidth
The weights are random, made on each GPU: decode speed depends on shapes and bytes, not values.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from engine import DATA_DIR, dtype_rule

DATA = DATA_DIR
SIZES = (4 << 10, 8 << 10, 16 << 10, 40 << 10, 64 << 10, 256 << 10, 1 << 20)
GPU_PATHS = ("nccl", "device_mailbox", "host_mailbox", "device_mailbox_graph")
CPU_PATHS = ("host_mailbox", "gloo")
# The engine's mailboxes wait on the host (polling), which a CUDA graph cannot hold; the GPU-side
# device_mailbox_graph (engine/allreduce/graph_mailbox.py) waits in a kernel.
GRAPH_PATHS = ("nccl", "device_mailbox_graph")
NO_GRAPH = "its wait polls from the host between kernels, which a CUDA graph cannot capture"


def size_label(nbytes: int) -> str:
    return f"{nbytes // 1024}k" if nbytes < (1 << 20) else f"{nbytes >> 20}m"


def known_data(nbytes: int, rank: int, dtype, device):
    """(this rank's input, the expected sum) for a bit-exact check; both sides round the same way."""
    import torch

    n = nbytes // dtype.itemsize
    base = (torch.arange(n, dtype=torch.float32) % 251) * 0.25
    mine = (base + 1000.0 * rank).to(dtype).to(device)
    expect = (base.to(dtype) + (base + 1000.0).to(dtype)).to(device)  # rank 0's + rank 1's, in that order
    return mine, expect


def bit_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))


def eager_us(fn, device, iters: int) -> float:
    """Median microseconds of fn(), synchronised before and after each call."""
    from engine.core import timing

    return timing.eager_us(fn, device, iters)


def allreduce_table(p, rank: int, device, dtype, iters: int, graph_ops: int, graph_ok: bool) -> dict:
    import torch

    row: dict = {"eager_us": {}, "graph_us": {}, "bit_exact": {}}
    if not graph_ok:
        row["graph_us"] = {"unavailable": f"{p.name}: {NO_GRAPH}" if p.name != "gloo" else "gloo is a CPU path"}
    for size in SIZES:
        label = size_label(size)
        mine, expect = known_data(size, rank, dtype, device)
        ok = bit_equal(p.allreduce_sum(mine), expect)
        x = torch.ones(size // dtype.itemsize, dtype=dtype, device=device)
        row["eager_us"][label] = round(eager_us(lambda: p.allreduce_sum(x), device, iters), 2)
        if graph_ok:
            out = {}

            def step():
                out["y"] = p.allreduce_sum(mine)

            from engine.core import timing

            def many():
                for _ in range(graph_ops):
                    step()

            g = timing.capture(many, device)
            us = timing.time_graph_ms(g, n=20) * 1e3 / graph_ops
            g.replay()
            torch.cuda.synchronize(device)
            ok = ok and bit_equal(out["y"], expect)  # the captured result, after a replay
            row["graph_us"][label] = round(us, 2)
            del g
        row["bit_exact"][label] = ok
    if hasattr(p, "check"):
        p.check()  # a GPU-side wait that timed out fails the table
    return row


def race_phase(rank, device, dtype, rdv, store) -> dict:
    from engine.allreduce import select

    t0 = time.perf_counter()
    choice = select.choose("auto", rank=rank, device=device, dtype=dtype, timeout_s=60.0, abort=None,
                           rendezvous_dir=rdv, generation=1, store=store, log=lambda m: None)
    out = {"picked": choice.path.name, "why": choice.why, "selftest": choice.selftest, "race_us": choice.race,
           "race_trusted": choice.race_trusted, "seconds": round(time.perf_counter() - t0, 2)}
    choice.path.close()
    return out


def judge_race(race: dict, table: dict) -> dict:
    """Is the race's pick the fastest path at 8 KB and 40 KB by the bench's own table (the engine's mode:
    graph where the path has one, else eager)?"""
    verdict = {}
    for label in ("8k", "40k"):
        cost = {}
        for name, row in table.items():
            if not isinstance(row, dict) or "eager_us" not in row:
                continue
            g = row["graph_us"].get(label) if isinstance(row.get("graph_us"), dict) else None
            cost[name] = g if g is not None else row["eager_us"][label]
        if cost:
            best = min(cost, key=cost.get)
            verdict[label] = {"fastest": best, "fastest_us": cost[best], "picked_us": cost.get(race.get("picked")),
                              "picked_is_fastest": best == race.get("picked")}
    return verdict


def build_model(cfg, world, rank, dtype, device, comm, max_ctx):
    from engine.core import weights
    from engine.core.model import Model

    m = Model(cfg, world=world, rank=rank, dtype=dtype, device=device, comm=comm)
    weights.init_random(m, seed=7 + rank)
    m.setup_cache(max_ctx)
    return m


def decode_eager(model, contexts: list[int], steps: int) -> dict:
    """Eager decode steps (no graph): median ms per step at each context."""
    import torch

    out = {}
    kv_per_pos = model.cfg.kv_bytes_per_token(model.head.element_size()) // model.world
    for ctx in contexts:
        window = -(-ctx // 256) * 256
        tok = torch.zeros(1, dtype=torch.long, device=model.device)
        pos = torch.full((1,), ctx - 1, dtype=torch.long, device=model.device)
        ms = eager_us(lambda: model.decode_step(tok, pos, window), model.device, steps) / 1e3
        out[str(ctx)] = {"window": window, "ms": round(ms, 4), "tok_s": round(1000 / ms, 2),
                         "kv_bytes": kv_per_pos * window}
    return out


def tp1_phase(cfg, rank, device, dtype, contexts, steps, max_ctx, peak_tflops) -> dict:
    import torch

    from engine.bench import decode as bench

    model = build_model(cfg, 1, 0, dtype, device, None, max_ctx)
    out: dict = {"weight_bytes": model.weight_bytes()}
    with torch.inference_mode():
        if device.type == "cuda":
            out["gemv"] = bench.gemv_only(model)
            out["decode_graph"] = bench.decode(model, contexts, KERNELS[0])
            if SERVED[0]:
                out["served"] = served_loop(model, SERVED[0], None)
            out["fit"] = bench.fit(out["decode_graph"], out["gemv"]["ms"], READ_BW[0])
            out["prefill"] = bench.prefill(model, tokens=min(2048, max_ctx))
            if peak_tflops:
                out["prefill"]["compute_fraction"] = round(out["prefill"]["tflops"] / peak_tflops, 4)
        out["decode_eager"] = decode_eager(model, contexts, steps)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def tp2_phase(cfg, rank, device, dtype, p, contexts, steps, max_ctx) -> dict:
    import torch

    from engine.allreduce.comm import Comm
    from engine.bench import decode as bench
    from engine.core.lockstep import Lockstep

    comm = Comm(p)
    model = build_model(cfg, 2, rank, dtype, device, comm, max_ctx)
    out: dict = {"weight_bytes_per_rank": model.weight_bytes()}
    with torch.inference_mode():
        tok = torch.zeros(1, dtype=torch.long, device=device)
        before = comm.calls
        model.decode_step(tok, torch.zeros(1, dtype=torch.long, device=device), 256)
        out["exchanges_per_step"] = comm.calls - before  # allreduces + the head's gather
        if device.type == "cuda" and p.name in GRAPH_PATHS:
            dec = bench.decode(model, contexts, KERNELS[0])
            out["decode_graph"] = dec  # K/V bytes: this rank's half of the KV heads
            if hasattr(p, "epilogue") and KERNELS[0] == "fused":
                # the same step with each other exchange mode, in the same run (A/B)
                from engine.core.decode_mode import EXCHANGES

                chosen = dec[str(contexts[0])].get("exchange")
                for mode in EXCHANGES:
                    if mode != chosen:
                        out[f"decode_graph_exchange_{mode}"] = bench.decode(model, contexts, KERNELS[0], exchange=mode)
        if device.type == "cuda" and SERVED[0] and p.name in GRAPH_PATHS:
            out["served"] = served_loop(model, SERVED[0], Lockstep(p, device, rank))
        out["decode_eager"] = decode_eager(model, contexts, steps)
    if hasattr(p, "check"):
        p.check()
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def served_loop(model, spec: tuple[int, int, int], lockstep) -> dict:
    """The service's loop on this model: engine.core.runner.run (chunked prefill, then the Decoder's graph
    replays, sampling on the host) with the rank's per-token lockstep (engine/service/rank.py's hook, minus its
    socket message: greedy tokens checked inside the step's graph, token 0 by an exchange). ms per token = (wall of the long run - wall of the short run) / extra
    tokens, so prefill and start-up cancel out, as the served bench measures the service."""
    import torch

    from engine.core import runner
    from engine.core.lockstep import Record, judge, token_hash
    from engine.core.sampling import Sampler

    prompt_len, short, long = spec
    window = -(-(prompt_len + long + 1) // 256) * 256
    if window > model.max_context:
        return {"unavailable": f"prompt {prompt_len} + {long} tokens exceed the context {model.max_context}"}
    t0 = time.perf_counter()
    dec = runner.prepare(model, bucket_list=[window])
    capture_s = time.perf_counter() - t0
    prompt = [(7 * i + 3) % model.cfg.vocab_size for i in range(prompt_len)]

    def once(n: int) -> tuple[float, list[int]]:
        sampler = Sampler()
        seq = [0]

        def hook(phase, k, toks, pos):
            if lockstep is not None:
                checked = model.decoder.checked if phase == "decode" else None
                if checked is not None:  # checked with the peer inside the step's graph, as the rank does
                    judge(checked, seq[0], model.rank)
                else:
                    lockstep.exchange(Record(seq[0], len(toks), token_hash(toks, sampler.offset), pos, 0))
            seq[0] += 1
            return False

        torch.cuda.synchronize(model.device)
        t = time.perf_counter()
        out, _ = runner.run(model, prompt, n, sampler, set(), 256, hook)
        torch.cuda.synchronize(model.device)
        return time.perf_counter() - t, out

    once(short)  # warm-up
    ts, tl = [], []
    for _ in range(3):
        ts.append(once(short)[0])
        t, out = once(long)
        tl.append(t)
    ms = (statistics.median(tl) - statistics.median(ts)) * 1e3 / (long - short)
    stats = dec.stats(READ_BW[0] or None)
    model.decoder = None
    del dec
    torch.cuda.empty_cache()
    return {"prompt_tokens": prompt_len, "short": short, "long": long, "window": window,
            "ms_per_token": round(ms, 4), "tok_s": round(1000 / ms, 2), "capture_s": round(capture_s, 2),
            "short_s": [round(x, 4) for x in ts], "long_s": [round(x, 4) for x in tl],
            "decoder": stats, "tokens_head": out[:8]}


READ_BW = [0.0]  # this rank's measured read bandwidth (GB/s), set before the TP1 phase
SERVED = [None]  # (prompt tokens, short, long) for the served-loop phase, or None to skip it
KERNELS = ["eager"]  # the decode step's blocks: --kernels, resolved per card by engine.core.decode_mode.kernel_choice


def worker(rank: int, rdv: str, args: argparse.Namespace, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from engine.allreduce.dist import init_control
    from engine.allreduce.graph_mailbox import GraphMailbox
    from engine.allreduce.select import build, same_device, selftest
    from engine.bench import decode as bench
    from engine.core import config as ecfg

    device = torch.device(f"cuda:{rank}" if args.device == "cuda" else args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    store = init_control(rdv, 0, rank, 2, float(args.timeout_s))
    torch.set_grad_enabled(False)
    doc: dict = {}
    from engine.core.runner import kernel_choice, triton_ok

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    KERNELS[0] = kernel_choice(device.type, cap, triton_ok(), None if args.kernels == "auto" else args.kernels)[0]
    if args.served:
        SERVED[0] = tuple(int(x) for x in args.served.split(","))

    def save(key, value):
        # Gather both ranks' value; rank 0 keeps the pair and rewrites the file after every phase.
        both = [None, None]
        dist.all_gather_object(both, value)
        if rank == 0:
            doc[key] = both
            Path(out_path).write_text(json.dumps(doc))

    def guarded(fn, *a):
        try:
            return fn(*a)
        except Exception as e:  # noqa: BLE001 - one phase failing must not lose the others
            return {"error": f"{type(e).__name__}: {str(e)[:400]}", "trace": traceback.format_exc()[-1500:]}

    raw = json.loads(Path(args.config).read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    cfg = ecfg.from_dict(raw)
    contexts = [int(c) for c in args.contexts.split(",")]
    max_ctx = -(-max(contexts) // 256) * 256 + 256
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "uuid": str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None,
            "shared_device": same_device(device)}
    save("card", info)
    if device.type == "cuda":
        READ_BW[0] = round(bench.read_bandwidth_gbps(device), 1)
        save("read_bw_gbps", READ_BW[0])
    else:
        READ_BW[0] = 1.0
    if not args.skip_race:
        save("race", guarded(race_phase, rank, device, dtype, rdv, store))

    names = GPU_PATHS if device.type == "cuda" else CPU_PATHS
    if args.paths:
        names = [n for n in args.paths.split(",") if n in names]
    paths = {}
    for gen, name in enumerate(names, start=2):
        why = None
        try:
            if name == "device_mailbox_graph":
                p = GraphMailbox(rank, 60.0, device=device, store=store, generation=gen, barrier=dist.barrier)
            else:
                p = build(name, rank=rank, device=device, timeout_s=60.0, abort=None, rendezvous_dir=rdv,
                          generation=gen, store=store, shared_device=info["shared_device"])
            why = selftest(p, rank, device, dtype)
        except Exception as e:  # noqa: BLE001 - a path that cannot start (any library error) is a result
            p, why = None, f"{type(e).__name__}: {str(e)[:300]}"
        both = [None, None]
        dist.all_gather_object(both, why)
        if any(both):
            save(f"allreduce.{name}", {"unavailable": "; ".join(w for w in both if w)})
            if p is not None:
                p.close()
            continue
        paths[name] = p
        graph_ok = device.type == "cuda" and name in GRAPH_PATHS
        save(f"allreduce.{name}", guarded(allreduce_table, p, rank, device, dtype, args.iters, args.graph_ops, graph_ok))

    if not args.skip_decode and not args.skip_tp1:
        save("tp1", guarded(tp1_phase, cfg, rank, device, dtype, contexts, args.eager_steps, max_ctx, args.peak_tflops))
    if not args.skip_decode:
        # Graph-captured paths last, the GPU-side mailbox last of all: a capture that hangs one rank must
        # not cost the other paths' results.
        last = {"nccl": 1, "device_mailbox_graph": 2}
        for name, p in sorted(paths.items(), key=lambda kv: last.get(kv[0], 0)):
            save(f"tp2.{name}", guarded(tp2_phase, cfg, rank, device, dtype, p, contexts, args.eager_steps, max_ctx))
    for p in paths.values():
        p.close()
    dist.barrier()
    dist.destroy_process_group()


def assemble(per_rank: dict, args: argparse.Namespace, meta: dict) -> dict:
    """Rank 0's view of each phase, with rank 1's where the two cards differ (bandwidth, TP1)."""
    doc = dict(meta)
    cards = per_rank.get("card", [None, None])
    doc["cards"] = cards
    doc["read_bw_gbps"] = per_rank.get("read_bw_gbps")
    doc["allreduce"] = {k.split(".", 1)[1]: v[0] for k, v in per_rank.items() if k.startswith("allreduce.")}
    race = (per_rank.get("race") or [None])[0] or {}
    doc["race"] = race
    if race and "picked" in race:
        doc["race"]["judged"] = judge_race(race, doc["allreduce"])
    if "tp1" in per_rank:
        doc["tp1"] = {"rank0": per_rank["tp1"][0], "rank1": per_rank["tp1"][1]}
    doc["tp2"] = {}
    for k, v in per_rank.items():
        if k.startswith("tp2."):
            r0 = v[0]
            doc["tp2"][k.split(".", 1)[1]] = r0
            if isinstance(r0, dict) and isinstance(v[1], dict) and "decode_graph" in v[1]:
                r0["rank1_decode_graph_ms"] = {c: e["ms"] for c, e in v[1]["decode_graph"].items()}
    doc["summary"] = summary(doc, str((doc.get("contexts") or [1024])[0]))
    return doc


def summary(doc: dict, ctx: str = "1024") -> dict:
    """The served-speed ratios, each from figures of this one run (None where a figure is missing):
    served TP2 ms/token vs the bench's TP2 graph step, TP2 vs TP1 (served and bench), and the TP1
    step against the floor at the measured read bandwidth."""
    def get(d, *keys):
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    out: dict = {"context": int(ctx)}
    tp1 = get(doc, "tp1", "rank0") or {}
    tp1_step = get(tp1, "decode_graph", ctx, "ms")
    tp1_served = get(tp1, "served", "ms_per_token")
    bw = (doc.get("read_bw_gbps") or [None])[0]
    w1 = tp1.get("weight_bytes")
    if tp1_step and bw and w1:
        floor = w1 / (bw * 1e9) * 1e3
        out["tp1"] = {"step_ms": tp1_step, "floor_ms": round(floor, 4), "read_bw_fraction": round(floor / tp1_step, 4),
                      "served_ms_per_token": tp1_served, "kernels": get(tp1, "decode_graph", ctx, "kernels")}
    for name, row in (doc.get("tp2") or {}).items():
        step = get(row, "decode_graph", ctx, "ms")
        served = get(row, "served", "ms_per_token")
        if step is None and served is None:
            continue
        r = {"step_ms": step, "served_ms_per_token": served,
             "served_vs_bench": round(step / served, 4) if step and served else None,
             "tp2_vs_tp1_bench": round(tp1_step / step, 4) if tp1_step and step else None,
             "tp2_vs_tp1_served": round(tp1_served / served, 4) if tp1_served and served else None,
             "allreduce_graph_us_8k": get(doc, "allreduce", name, "graph_us", "8k")}
        if get(row, "decode_graph", ctx, "exchange"):
            r["exchange"] = get(row, "decode_graph", ctx, "exchange")
        for mode in ("kernel", "send"):  # the A/B of the same run: the other exchange mode
            ak = get(row, f"decode_graph_exchange_{mode}", ctx, "ms")
            if ak:
                r[f"step_ms_exchange_{mode}"] = ak
                r[f"tp2_vs_tp1_bench_exchange_{mode}"] = round(tp1_step / ak, 4) if tp1_step else None
        out[name] = r
    race = doc.get("race") or {}
    out["race_picked"] = race.get("picked")
    out["race_picked_is_fastest"] = {k: v.get("picked_is_fastest") for k, v in (race.get("judged") or {}).items()}
    return out


from engine.bench.decode import HelpFormatter  # noqa: E402 - one help layout for the benches


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m engine bench-tp2", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--config", default=str(DATA / "llama-3.1-8b.config.json"), help="a config.json (real shape)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    p.add_argument("--contexts", default="1024,4096,16384,32768")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda: rank r on cuda:r")
    p.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=300, help="eager allreduces per size")
    p.add_argument("--graph-ops", type=int, default=20, help="allreduces captured per graph")
    p.add_argument("--eager-steps", type=int, default=30, help="eager decode steps per context")
    p.add_argument("--peak-tflops", type=float, default=None, help="the card's dense fp16/bf16 tensor peak")
    p.add_argument("--peak-source", default=None, help="where --peak-tflops comes from (datasheet name)")
    p.add_argument("--kernels", default="auto", choices=("auto", "eager", "fused"),
                   help="the decode step's blocks (auto: as the service chooses for the card)")
    p.add_argument("--served", default="500,16,144",
                   help="served-loop phase: prompt tokens, short and long generation ('' to skip)")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-tp1", action="store_true", help="TP2 only (TP1 recorded elsewhere)")
    p.add_argument("--skip-race", action="store_true")
    p.add_argument("--paths", default=None, help="comma-separated allreduce paths (default: all for the device)")
    p.add_argument("--timeout-s", type=int, default=420, help="the whole run's bound")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    import multiprocessing as mp

    import torch

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(json.dumps({"kind": "engine_bench_tp2", "error": "needs two CUDA GPUs",
                          "cuda_devices": torch.cuda.device_count()}))
        return 4
    args.dtype = dtype_rule.resolve(args.dtype, torch.cuda.get_device_capability(0) if args.device == "cuda"
                                    else dtype_rule.CPU)
    nccl = None
    if args.device == "cuda" and torch.distributed.is_nccl_available():
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
    meta = {
        "kind": "engine_bench_tp2",
        "compute_capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if args.device == "cuda" else None,
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
        "dtype": args.dtype, "config": Path(args.config).name, "layers_override": args.layers,
        "contexts": [int(c) for c in args.contexts.split(",")], "sizes": [size_label(s) for s in SIZES],
        "peak_tflops": args.peak_tflops, "peak_source": args.peak_source,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS")},
        "method": (f"one process per GPU; allreduce eager: median of {args.iters} synchronised calls; graph: "
                   f"{args.graph_ops} calls per CUDA graph, median of 5 x 20 replays; decode graph: median of "
                   f"5 x 50 replays; decode eager: median of {args.eager_steps} synchronised steps; random weights"),
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="v100plan-tp2-") as d:
        out = os.path.join(d, "tp2.json")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(r, d, args, out)) for r in range(2)]
        for pr in procs:
            pr.start()
        deadline = time.monotonic() + args.timeout_s
        for pr in procs:
            pr.join(timeout=max(1.0, deadline - time.monotonic()))
        timed_out = any(pr.is_alive() for pr in procs)
        for pr in procs:
            if pr.is_alive():
                pr.kill()
                pr.join(5)
        per_rank = json.loads(Path(out).read_text()) if os.path.exists(out) else {}
    doc = assemble(per_rank, args, meta)
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    if timed_out:
        doc["incomplete"] = f"the ranks did not finish within {args.timeout_s} s; phases after the last one shown are missing"
    elif any(pr.exitcode for pr in procs):
        doc["incomplete"] = f"rank exit codes {[pr.exitcode for pr in procs]}"
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0 if per_rank and "incomplete" not in doc else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
