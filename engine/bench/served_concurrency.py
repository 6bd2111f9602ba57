"""`python -m engine.bench.served_concurrency`: `serve --max-concurrency N` measured through HTTP, as clients see it.

  1. a checkpoint: --model DIR, or a random-weight one of --config's shape (--layers to cut it) written to disk;
  2. `python -m engine serve --tp 2 --max-concurrency max(C)` on it (127.0.0.1; --no-batch-graphs passed through);
  3. for each C in --batches: C non-streamed greedy completions released together, each with its own prompt of
     --prompt-tokens token ids, first of --short then of --long generated tokens (ignore_eos), --rounds times;
     per-request ms/token = (median long wall - median short wall) / (long - short), so the prefill and the HTTP
     round trip cancel out; aggregate tok/s = C x 1000 / that; both next to C = 1 of this run;
  4. the prefill budget: one stream of --long tokens; after its --interfere-after'th token a prompt of
     --interfere-tokens tokens is sent; the stream's token gaps while that prompt is prefilled (until its first
     token) against the gaps before it: median, p99, max.
Prints one JSON document (also written to --out, rewritten after every phase). On CPU (--devices cpu,cpu) it runs
the same steps on a small checkpoint (what the tests do); the figures worth reading are a GPU pair's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from engine import DATA_DIR
from engine.bench import served
from engine.bench.concurrency import batch_list


def per_request_ms(short_s: list[float], long_s: list[float], short: int, long: int) -> float:
    """ms per generated token of one request: the median walls' difference over the tokens between them."""
    return (statistics.median(long_s) - statistics.median(short_s)) * 1e3 / (long - short)


def figures(batches: dict[int, float]) -> dict:
    """{C: per-request ms/token} -> per C: ms, per-request and aggregate tok/s, both over C = 1 (when timed)."""
    out, one = {}, batches.get(1)
    for c, ms in sorted(batches.items()):
        row = {"per_request_ms_per_token": round(ms, 4), "per_request_tok_s": round(1000 / ms, 2),
               "aggregate_tok_s": round(c * 1000 / ms, 2)}
        if one:
            row.update(aggregate_over_1=round(one / ms * c, 3), per_request_over_1=round(one / ms, 3))
        out[str(c)] = row
    return out


def gaps(arrivals: list[float], start: float, end: float | None) -> dict:
    """The token gaps (ms) of a stream, split at [start, end): before, and while the other prompt was prefilled."""
    pairs = list(zip(arrivals, arrivals[1:]))
    during = [b - a for a, b in pairs if b >= start and (end is None or a < end)]
    before = [b - a for a, b in pairs if b < start]

    def stats(g: list[float]) -> dict:
        q = sorted(g)
        return {"n": len(g), "median_ms": round(statistics.median(g), 3) if g else None,
                "p99_ms": round(q[min(len(q) - 1, int(0.99 * len(q)))], 3) if q else None,
                "max_ms": round(max(g), 3) if g else None}
    return {"before": stats(before), "during_prefill": stats(during)}


def _together(port: int, prompts: list[list[int]], n: int) -> list[float]:
    """Completions of ``n`` tokens for every prompt, released together: each one's wall seconds."""
    walls: list[float | None] = [None] * len(prompts)
    errors: list[str] = []
    go = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        go.wait()
        try:
            dt, body = served.timed(port, served.complete(port, "bench", prompts[i], n))
            if body.get("usage", {}).get("completion_tokens") != n:
                errors.append(f"request {i}: {body.get('usage')} (asked {n} tokens)")
            walls[i] = dt
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return walls  # type: ignore[return-value]


def _interference(port: int, stream_prompt: list[int], long_prompt: list[int], n: int, after: int) -> dict:
    """A stream of n tokens; once it has ``after`` tokens, the long prompt (one token asked) is sent beside it."""
    mark: dict = {}
    box: dict = {}

    def other() -> None:
        while "sent" not in mark:
            time.sleep(0.001)
        dt, _ = served.timed(port, served.complete(port, "bench", long_prompt, 1))
        mark["answered"] = mark["sent"] + dt * 1e3

    t0 = time.perf_counter()
    side = threading.Thread(target=other)
    side.start()

    def watch(arrivals: list[float]) -> None:
        if len(arrivals) == after and "sent" not in mark:
            mark["sent"] = (time.perf_counter() - t0) * 1e3

    box.update(served.stream_gaps(port, served.complete(port, "bench", stream_prompt, n, stream=True),
                                  on_event=watch, t0=t0))
    side.join()
    arrivals = box["arrivals_ms"]
    return {"stream_tokens": box["events"], "long_prompt_tokens": len(long_prompt),
            "sent_at_ms": round(mark.get("sent", 0.0), 3), "answered_at_ms": round(mark.get("answered", 0.0), 3),
            **gaps(arrivals, mark.get("sent", 0.0), mark.get("answered"))}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.bench.served_concurrency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DATA_DIR / "qwen3.5-27b.config.json"), help="the random checkpoint's shape")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a shorter random model)")
    p.add_argument("--model", default=None, help="serve this checkpoint instead of writing a random one")
    p.add_argument("--devices", default="cuda:0,cuda:1")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--batches", default="1,2,4,8", help="requests at once, comma-separated")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=80)
    p.add_argument("--rounds", type=int, default=2, help="times each C is sent (short, then long)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--interfere-tokens", type=int, default=3000, help="0: skip step 4")
    p.add_argument("--interfere-after", type=int, default=8)
    p.add_argument("--no-batch-graphs", dest="batch_graphs", action="store_false", help="serve --no-batch-graphs")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--workdir", default=None, help="where the random checkpoint goes (default: a temp dir)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.batch_list = batch_list(p, args.batches)
    if not 1 <= args.short < args.long:
        p.error("--short must be at least 1 and below --long")
    need = args.prompt_tokens + args.long
    if args.max_context <= max(need, args.interfere_tokens + 1):
        p.error(f"--max-context {args.max_context} must exceed --prompt-tokens + --long ({need}) and "
                f"--interfere-tokens")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    doc: dict = {"kind": "engine_bench_served_concurrency",
                 "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "devices": args.devices, "dtype": args.dtype, "batches": args.batch_list,
                 "prompt_tokens": args.prompt_tokens, "short": args.short, "long": args.long, "rounds": args.rounds,
                 "max_context": args.max_context, "batch_graphs": args.batch_graphs,
                 "method": "per C: C greedy completions released together (a barrier), each its own prompt; "
                           "per-request ms/token = (median long wall - median short wall) / (long - short); "
                           "aggregate = C x 1000 / that"}

    def emit() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")

    work = Path(args.workdir or tempfile.mkdtemp(prefix="v100plan-served-conc-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.model:
        model_dir = Path(args.model)
        doc["checkpoint"] = {"model": str(model_dir)}
    else:
        config = args.config
        if args.layers:
            raw = json.loads(Path(config).read_text())
            raw["num_hidden_layers"] = args.layers
            raw.pop("layer_types", None)
            config = str(work / "config.json")
            Path(config).write_text(json.dumps(raw))
        model_dir = work / "model"
        doc["checkpoint"] = served.write_random_checkpoint(config, model_dir, args.dtype, args.devices.split(",")[0])
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size", 32000)
    doc["config"] = json.loads((model_dir / "config.json").read_text()).get("model_type")
    emit()
    extra = ["--max-concurrency", str(max(args.batch_list)), "--queue-cap", str(max(args.batch_list) + 1)]
    proc, port, cmd, log = served.start_serve(work, args.devices, args.dtype, args.max_context,
                                              model_dir=model_dir, extra=extra + ([] if args.batch_graphs
                                                                                  else ["--no-batch-graphs"]))
    doc["serve_command"] = cmd
    serial = iter(range(1_000_000))

    def prompt(n: int) -> list[int]:
        k = next(serial)  # every request its own prompt: no prefix reuse between them
        return [(7 * i + 13 * k + 3) % (vocab - 20) + 10 for i in range(n)]

    try:
        t0 = time.perf_counter()
        health = served.wait_healthy(port, proc, args.start_timeout_s)
        doc["start_s"] = round(time.perf_counter() - t0, 1)
        doc["health"] = {k: health.get(k) for k in ("max_concurrency", "concurrency", "allreduce")}
        served.timed(port, served.complete(port, "bench", prompt(args.prompt_tokens), args.short))  # warm-up
        walls, per_c = {}, {}
        for c in args.batch_list:
            shorts, longs = [], []
            for _ in range(args.rounds):
                shorts += _together(port, [prompt(args.prompt_tokens) for _ in range(c)], args.short)
                longs += _together(port, [prompt(args.prompt_tokens) for _ in range(c)], args.long)
            walls[str(c)] = {"short_s": [round(x, 6) for x in shorts], "long_s": [round(x, 6) for x in longs]}
            per_c[c] = per_request_ms(shorts, longs, args.short, args.long)
            doc["served"] = figures(per_c)
            doc["walls"] = walls
            emit()
        if args.interfere_tokens:
            doc["prefill_interference"] = _interference(port, prompt(args.prompt_tokens),
                                                        prompt(args.interfere_tokens), args.long,
                                                        args.interfere_after)
        status, text = served._request(port, "/health")
        doc["decode"] = json.loads(text).get("decode") if status == 200 else None
    except Exception as e:  # noqa: BLE001 - a failed phase is a result; the log says why
        doc["error"] = f"{type(e).__name__}: {e}"
    finally:
        served.end_serve(proc, log, work, doc, emit, remove=not args.workdir and not args.model)
    doc["wall_s"] = round(time.perf_counter() - t_start, 1)
    emit()
    print(json.dumps(doc, indent=1))
    return 0 if "error" not in doc else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
