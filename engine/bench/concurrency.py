"""`python -m engine.bench.concurrency`: the batched decode step that `serve --max-concurrency N` runs
(engine.core.model.Model.decode_batch) at C sequences at once, next to the one-sequence step the service runs at
N = 1, on a real-shape random-weight model, printed as one JSON document.

What each number is (every time a median over CUDA-graph replays between CUDA events: engine.core.timing):
  read_bw_gbps        sum over a 4 GiB float32 buffer: the card's measured read bandwidth
  prediction[C]       written into the document before anything is timed: the step's floor, (weight bytes +
                      C x (K/V bytes up to the context + linear-attention state read and written)) / read_bw, and
                      the floor's aggregate tok/s; what the batch can gain at best over C = 1
  solo                the one-sequence service step at the context (engine.bench.decode.decode: the Decoder's CUDA
                      graph for that window with the kernels the service picks on this card): ms, tok/s, of floor
  batched[C]          the service's batched step for C sequences (slots 0..C-1, every row at position context - 1):
                      engine.service.batch_graphs' graph of C's row bucket (1, 2, 4, ... up to the largest C; a C
                      between two buckets runs the larger, padded) at the Decoder's window for that position: ms per
                      step, aggregate tok/s (C x 1000 / ms), per-request tok/s (1000 / ms), step_ratio = ms / ms at
                      C = 1 batched, of_floor; eager_ms: the same step launched eagerly (10 in a row between CUDA
                      events, launches included: what the service ran before the step was captured), eager_over_graph
  targets             the issue's targets from these figures: aggregate at C = 8 over C = 1 (>= 5), per-request at
                      C = 8 over C = 1 (>= 0.6), each against the batched C = 1 and against the solo step
  agreement           with --agree T: C sequences (distinct random prompts) decoded T greedy tokens together
                      by decode_batch, and each alone by the one-sequence torch step (decode_step, kernels None) from
                      the same prefilled state: the fraction of tokens equal and the first step each differs at
                      (bf16 does not promise batch invariance: cuBLAS picks other kernels for other row counts)
--int4 packs every layer matrix (engine.bench.int4.pack_layers: random GPTQ words, group --group), so the products
of 2..16 rows run the batched int4 GEMV (engine.kernels.gemv_int4.linear_rows). The weights are random (shape
and bytes are what the speed depends on), made on the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine import DATA_DIR, dtype_rule
from engine.bench.decode import emit_json, state_bytes_per_step, x_bytes_over_ms


def _floor_ms(weight_bytes: int, per_seq_bytes: int, c: int, read_gbps: float) -> float:
    return (weight_bytes + c * per_seq_bytes) / (read_gbps * 1e9) * 1e3


def predictions(weight_bytes: int, per_seq_bytes: int, batches: list[int], read_gbps: float) -> dict:
    """The floor per C, written before any timing: every weight read once a step, each sequence's K/V and
    linear-attention state on top."""
    one = _floor_ms(weight_bytes, per_seq_bytes, 1, read_gbps)
    out = {}
    for c in batches:
        ms = _floor_ms(weight_bytes, per_seq_bytes, c, read_gbps)
        out[str(c)] = {"floor_ms": round(ms, 4), "floor_aggregate_tok_s": round(c * 1000 / ms, 1),
                       "floor_step_ratio": round(ms / one, 4)}
    return out


def targets(batched: dict, solo_tok_s: float | None) -> dict:
    """The issue's two ratios at C = 8 (or the largest C timed, named), against batched C = 1 and the solo step."""
    cs = sorted(int(c) for c, v in batched.items() if "error" not in v)  # a C with no graph: left out
    if 1 not in cs or len(cs) < 2:
        return {}
    c = 8 if 8 in cs else cs[-1]
    one, at = batched["1"], batched[str(c)]
    out = {"c": c, "aggregate_over_batched_1": round(at["aggregate_tok_s"] / one["aggregate_tok_s"], 3),
           "per_request_over_batched_1": round(at["per_request_tok_s"] / one["per_request_tok_s"], 3)}
    if solo_tok_s:
        out["aggregate_over_solo"] = round(at["aggregate_tok_s"] / solo_tok_s, 3)
        out["per_request_over_solo"] = round(at["per_request_tok_s"] / solo_tok_s, 3)
    out["aggregate_target_5x_met"] = out.get("aggregate_over_solo", out["aggregate_over_batched_1"]) >= 5
    out["per_request_target_60pct_met"] = out.get("per_request_over_solo", out["per_request_over_batched_1"]) >= 0.6
    return out


def eager_ms(model, toks, pos, slots, window: int, steps: int = 10) -> float:
    """decode_batch launched eagerly, ``steps`` in a row between CUDA events (no host sync between them): ms per
    step, the launches included (what the service ran before its batched step was captured)."""
    import torch

    for _ in range(2):
        model.decode_batch(toks, pos, slots, window)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        model.decode_batch(toks, pos, slots, window)
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / steps


def profile_step(model, toks, pos, slots, window: int, steps: int = 3, top: int = 30) -> dict:
    """The batched step launched eagerly ``steps`` times under torch.profiler (CUDA activity only): GPU time per
    step and its kernels by total time (name, calls per step, us per step, share), the ``top`` largest."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    model.decode_batch(toks, pos, slots, window)
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            model.decode_batch(toks, pos, slots, window)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append((us / steps, e.count / steps, e.key))
    total = sum(r[0] for r in rows)
    rows.sort(reverse=True)
    return {"steps": steps, "gpu_us_per_step": round(total, 1), "kernels": [
        {"name": k[:120], "calls": round(n, 2), "us": round(us, 1), "share": round(us / total, 4)}
        for us, n, k in rows[:top]]}


def batched(model, batches: list[int], context: int, read_gbps: float, per_seq_bytes: int,
            eager: bool = True, profile_c: int = 0) -> dict:
    """The service's batched step (engine.service.batch_graphs: the graph of C's row bucket at the window the
    Decoder picks for position context - 1), every row at position context - 1 in its own slot; ``eager``: the
    same step launched eagerly too."""
    import torch

    from engine.core import runner, timing
    from engine.service.batch_graphs import BatchGraphs

    window = next(w for w in runner.buckets(model.max_context) if context - 1 < w)  # the Decoder's window rule
    graphs = BatchGraphs(model, max(batches), [window])
    graphs.capture()
    w = model.weight_bytes()
    out, base = {}, None
    for c in batches:
        r, win = graphs.load([1] * c, [context - 1] * c, list(range(c)), [context - 1] * c)
        g = graphs.graph(r, win)
        if g is None:
            out[str(c)] = {"error": f"no graph for {r} rows at window {win}: {graphs.info.get('eager_why')}"}
            continue
        ms = timing.time_graph_ms(g)
        base = base or ms
        floor = _floor_ms(w, per_seq_bytes, c, read_gbps)
        out[str(c)] = {"rows": r, "window": win, "ms": round(ms, 4), "aggregate_tok_s": round(c * 1000 / ms, 2),
                       "per_request_tok_s": round(1000 / ms, 2), "step_ratio": round(ms / base, 4),
                       "of_floor": round(floor / ms, 4),
                       "total_gbps": round(x_bytes_over_ms(w + c * per_seq_bytes, ms), 1)}
        if eager:
            e = eager_ms(model, graphs.toks[:r], graphs.pos[:r], graphs.slots[:r], win)
            out[str(c)].update(eager_ms=round(e, 4), eager_over_graph=round(e / ms, 3))
        if c == profile_c:
            out[str(c)]["profile"] = profile_step(model, graphs.toks[:r], graphs.pos[:r], graphs.slots[:r], win)
    del graphs
    torch.cuda.empty_cache()
    return out


def agreement(model, c: int, steps: int, prompt: int = 16) -> dict:
    """C random prompts prefilled into slots 0..C-1, then ``steps`` greedy tokens decoded together; then each
    sequence again from its prompt alone (slot reset, prefilled, decode_step's torch form): tokens equal?"""
    import torch

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, model.cfg.vocab_size, (prompt,), generator=g).tolist() for _ in range(c)]
    window = -(-(prompt + steps + 1) // 256) * 256
    with torch.inference_mode():
        firsts = []
        for s, ids in enumerate(prompts):
            model.reset_slot(s)
            firsts.append(int(model.prefill_slot(s, ids).argmax()))
        together = [[t] for t in firsts]
        toks = torch.tensor(firsts, device=model.device)
        slots = torch.arange(c, device=model.device)
        for i in range(steps - 1):
            pos = torch.full((c,), prompt + i, dtype=torch.long, device=model.device)
            toks = model.decode_batch(toks, pos, slots, window).argmax(-1)
            for s, t in enumerate(toks.tolist()):
                together[s].append(t)
        alone = []
        for s, ids in enumerate(prompts):
            model.reset_slot(s)
            model.use_slot(s)
            seq = [int(model.prefill_slot(s, ids).argmax())]
            for i in range(steps - 1):
                tok = torch.tensor([seq[-1]], device=model.device)
                pos = torch.tensor([prompt + i], device=model.device)
                seq.append(int(model.decode_step(tok, pos, window).argmax()))
            alone.append(seq)
        model.use_slot(0)
    equal = sum(a == b for x, y in zip(together, alone) for a, b in zip(x, y))
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(together, alone)]
    return {"c": c, "steps": steps, "tokens_equal_fraction": round(equal / (c * steps), 4),
            "first_difference_at": first, "sequences_identical": sum(f is None for f in first)}


def batch_list(p: argparse.ArgumentParser, text: str) -> list[int]:
    """--batches: C values, comma-separated, each 1..64 (sorted, once each); else the parser's error (exit 2)."""
    try:
        cs = sorted({int(c) for c in text.split(",") if c})
    except ValueError:
        p.error(f"--batches takes whole numbers separated by commas, not {text!r}")
    if not cs or not all(1 <= c <= 64 for c in cs):
        p.error("--batches: each C between 1 and 64")
    return cs


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench.concurrency", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"), help="a config.json (real shape)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick runs)")
    p.add_argument("--context", type=int, default=4096, help="every sequence's position (its K/V read each step)")
    p.add_argument("--batches", default="1,2,4,8,16", help="concurrent sequences C, comma-separated")
    p.add_argument("--int4", action="store_true", help="every layer matrix packed int4 (GPTQ)")
    p.add_argument("--group", type=int, default=128, help="--int4's group size")
    p.add_argument("--dtype", default=None, choices=("float16", "bfloat16", "float32"))
    p.add_argument("--agree", type=int, default=0, help="greedy tokens for the agreement check (0: skip)")
    p.add_argument("--skip-solo", action="store_true", help="do not time the one-sequence service step")
    p.add_argument("--skip-eager", action="store_true", help="do not time the batched step launched eagerly")
    p.add_argument("--profile", type=int, default=0, metavar="C",
                   help="also profile the batched step at this C (its kernels by GPU time; 0: none)")
    p.add_argument("--int4-one-row-upto", type=int, default=None, metavar="R",
                   help="--int4: run products of up to R rows as R one-row GEMVs (default: the engine's)")
    p.add_argument("--rows-torch", action="store_true",
                   help="the batched step's attention and Gated DeltaNet mix in their torch forms (per-row gathers), "
                        "not the kernels the service runs: the comparison")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="also write the JSON here (rewritten after every phase)")
    args = p.parse_args(argv)
    args.batch_list = batch_list(p, args.batches)
    if args.context < 2:
        p.error("--context must be at least 2")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    import torch

    from engine.bench import decode as dbench
    from engine.core import config as ecfg
    from engine.core import weights
    from engine.core.model import Model
    from profiles.document import utc_now

    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        print(json.dumps({"error": "the concurrency benchmark needs a CUDA GPU"}))
        return 4
    dev = torch.device(args.device if ":" in args.device else "cuda:0")
    torch.cuda.set_device(dev)
    cap = torch.cuda.get_device_capability(dev)
    dtype = dtype_rule.resolve(args.dtype, cap)
    raw = json.loads(Path(args.config).read_text())
    if args.layers:
        raw["num_hidden_layers"] = args.layers
        raw.pop("layer_types", None)
    cfg = ecfg.from_dict(raw)
    torch.set_grad_enabled(False)
    doc: dict = {"kind": "engine_bench_concurrency", "created_utc": utc_now(), "device": torch.cuda.get_device_name(dev),
                 "compute_capability": f"{cap[0]}.{cap[1]}", "torch": torch.__version__, "dtype": dtype,
                 "config": Path(args.config).name, "num_layers": cfg.num_layers, "context": args.context,
                 "weights": "int4 (GPTQ, group %d)" % args.group if args.int4 else dtype,
                 "method": "CUDA events; median of 5 batches of 50 graph replays; random weights made on the GPU"}
    doc["read_bw_gbps"] = round(dbench.read_bandwidth_gbps(dev), 1)
    from engine.kernels import gemv_int4

    if args.int4_one_row_upto is not None:
        gemv_int4.ONE_ROW_UPTO[0] = args.int4_one_row_upto
    doc["int4_one_row_upto"] = gemv_int4.ONE_ROW_UPTO[0]
    from engine.model import base

    base.ROWS_KERNELS[0] = not args.rows_torch
    doc["rows_attention_and_gdn"] = "torch" if args.rows_torch else "kernels"
    if args.int4:  # as engine.bench.int4's step: the quantised config, every layer matrix then packed
        import dataclasses

        from engine.core import quant_config

        cfg = dataclasses.replace(cfg, quantization=quant_config.parse(
            {"quant_method": "gptq", "bits": 4, "group_size": args.group, "sym": True, "desc_act": False}))
    with torch.inference_mode():
        model = Model(cfg, dtype=getattr(torch, dtype), device=dev)
        if args.int4:
            from engine.bench.int4 import pack_layers

            pack_layers(model, args.group, torch.Generator(device=dev).manual_seed(3))
        weights.init_random(model)
        model.setup_cache(-(-args.context // 256) * 256 + 256, slots=max(args.batch_list))
    kv_per_pos = model.state_bytes()["kv_cache"] // (model.max_context * model.slots)
    per_seq = kv_per_pos * args.context + state_bytes_per_step(model)
    doc.update(weight_bytes=model.weight_bytes(), per_sequence_bytes_per_step=per_seq,
               prediction=predictions(model.weight_bytes(), per_seq, args.batch_list, doc["read_bw_gbps"]))
    emit_json(doc, args.out)
    with torch.inference_mode():
        if not args.skip_solo:
            doc["solo"] = dbench.decode(model, [args.context], None, doc["read_bw_gbps"])[str(args.context)]
            emit_json(doc, args.out)
        doc["batched"] = batched(model, args.batch_list, args.context, doc["read_bw_gbps"], per_seq,
                                 eager=not args.skip_eager, profile_c=args.profile)
    doc["targets"] = targets(doc["batched"], doc.get("solo", {}).get("tok_s"))
    emit_json(doc, args.out)
    if args.agree:
        doc["agreement"] = agreement(model, min(4, max(args.batch_list)), args.agree)
        emit_json(doc, args.out)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
