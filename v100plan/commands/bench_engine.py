"""`v100plan bench engine`: run the engine benchmark on this GPU host (`python -m engine bench` as a
subprocess) and turn its measurements into an EngineProfile the planner reads.

How each efficiency is derived from the bench JSON (engine/bench.py says how each is measured):
  weight_bw_fraction        GEMV-only GB/s (every weight matrix once, batch 1, one CUDA graph) / read GB/s
  kv_bw_fraction            1 / slope of step time over K/V bytes read, / read GB/s
  round_overhead_ms         intercept of that line minus the GEMV-only time: what a round costs beyond bytes
  prefill_compute_fraction  achieved TFLOP/s on a 2048-token chunk / the card's dense fp16/bf16 tensor peak
The decode variant used is the fastest one measured (the compiled step when torch.compile ran).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from profiles.document import SCHEMA_VERSIONS, provenance
from v100plan import documents, output
from v100plan.errors import BadInput, EnvironmentProblem
from v100plan.options import JsonOpt, OutOpt, QuietOpt

SHAPES = ("llama-3.1-8b", "qwen3-8b")
PATH_NAMES = ("nccl", "gloo", "host_mailbox", "device_mailbox")


def best_variant(bench: dict[str, Any]) -> str:
    """The fastest decode variant (shortest step at the smallest context all of them measured) among
    those whose step time grew with the context, so their line through the points means something."""
    variants = {k: v for k, v in bench["decode"].items()
                if "unavailable" not in v and (bench["fit"].get(k) or {}).get("kv_bw_fraction")}
    if not variants:
        raise BadInput("no decode variant in this bench has a usable fit (two or more contexts, time "
                       "growing with context)", hint="run the bench with more than one context")
    common = set.intersection(*(set(v) for v in variants.values()))
    ctx = min(common, key=int)
    return min(variants, key=lambda k: variants[k][ctx]["ms"])


def engine_profile(bench: dict[str, Any], profile_id: str = "v100plan-measured",
                   bench_file: str | None = None) -> dict[str, Any]:
    """EngineProfile document from one `python -m engine bench` result (a pure function)."""
    where = f"{bench['device']} (cc {bench['compute_capability']}), torch {bench['torch']}"
    date = bench.get("created_utc", "")[:10] or "date not recorded"
    src = f"measured: v100plan bench engine on {where}, {date}, {bench['config']} shape, {bench['dtype']}"
    variant = best_variant(bench)
    fit = bench["fit"][variant]
    read = bench["read_bw_gbps"]

    def num(value, note: str) -> dict[str, Any]:
        return {"value": None if value is None else round(value, 4), "source": src, "note": note}

    weight = bench["gemv"]["weight_gbps"] / read
    weight_note = f"GEMV-only {bench['gemv']['weight_gbps']} GB/s / read {read} GB/s"
    overhead = fit.get("round_overhead_ms")
    overhead_note = f"{variant}: intercept {fit.get('intercept_ms')} ms - GEMV-only {bench['gemv']['ms']} ms"
    if overhead is not None and overhead < 0:
        # The step's fixed part beat the separate GEMV-only run (the compiled step fuses its own
        # matrix-vector kernels): all of the intercept is then weight reading, at that speed.
        weight = bench["gemv"]["weight_bytes"] / (fit["intercept_ms"] * 1e-3) / 1e9 / read
        weight_note = f"{variant}: weight bytes / intercept {fit['intercept_ms']} ms / read {read} GB/s"
        overhead, overhead_note = 0.0, f"{variant}: intercept below the GEMV-only time: no overhead left to see"
    prefill = bench.get("prefill") or {}
    pf = prefill.get("compute_fraction")
    efficiency = {
        "weight_bw_fraction": num(weight, weight_note),
        "kv_bw_fraction": num(fit.get("kv_bw_fraction"),
                              f"{variant}: 1 / slope of step time over K/V bytes ({fit.get('kv_gbps')} GB/s) / read"),
        "round_overhead_ms": num(overhead, overhead_note),
        "prefill_compute_fraction": num(
            pf, f"{prefill.get('tflops')} TFLOP/s on a {prefill.get('tokens')}-token chunk / "
                f"{bench.get('peak_tflops')} TFLOP/s ({bench.get('peak_source') or 'no peak given'})"
            if pf is not None else "no tensor peak given: run with --peak-tflops or a catalogued --hardware"),
    }
    ar = bench.get("allreduce_us") or {}
    allreduce = {name: row for name, row in ar.items() if name in PATH_NAMES}
    shared = ar.get("shared_device")
    doc = {
        "kind": "engine_profile",
        "schema_version": SCHEMA_VERSIONS["engine_profile"],
        "provenance": provenance({"bench": bench_file or "measured now", "config": bench["config"],
                                  "contexts": sorted(map(int, bench["decode"][variant]))},
                                 cuda=bench.get("cuda"), torch=bench.get("torch"), method=bench.get("method")),
        "id": profile_id,
        "name": f"v100plan engine, measured on {bench['device']}",
        "description": (f"Batch-1 TP1 decode of a random-weight {bench['config']} model ({bench['dtype']}) with the "
                         f"engine's own decode step ({variant}); fractions are of the read bandwidth measured in "
                         f"the same run ({read} GB/s)."),
        "status": "measured",
        "efficiency": efficiency,
        "prefill_chunk_tokens": prefill.get("tokens", 2048),
        "speculative": {"draft_tokens": 0, "default_acceptance": 0.0, "source": "the bundled engine does not speculate"},
        "allreduce_paths": [p for p in PATH_NAMES if p in allreduce and "unavailable" not in allreduce[p]],
        "allreduce_us": allreduce,
        "allreduce_source": src + (": both ranks on ONE GPU, so these are not two-card latencies"
                                   if shared else ": two ranks on this host"),
    }
    return doc


def _peak_from_catalogue(hardware: str, dtype: str) -> tuple[float | None, str | None]:
    from v100plan import catalogue

    hw = catalogue.get("hardware", hardware)
    key = "bf16_tensor_tflops" if dtype == "bfloat16" else "fp16_tensor_tflops"
    value = hw.get(key)
    if value is None:
        return None, None
    source = (hw.get("sources") or {}).get(key) or f"catalogue {hardware}.{key}"
    return float(value), source if isinstance(source, str) else json.dumps(source)


def run_bench(python: str, args: list[str], quiet: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="v100plan-bench-") as d:
        out = os.path.join(d, "bench.json")
        repo = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [python, "-m", "engine", "bench", "--out", out, *args]
        if not quiet:
            output.hint(f"running: {' '.join(cmd)} (minutes: random weights, CUDA graphs, torch.compile)")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0 or not os.path.exists(out):
            last = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or ["no output"])[-1]
            raise EnvironmentProblem(f"the engine benchmark did not run: {last[:400]}",
                                     hint="it needs a CUDA GPU and the engine extra (pip install 'v100plan[engine]')")
        return json.loads(Path(out).read_text())


def register(app: typer.Typer) -> None:
    @app.command("engine")
    def bench_engine(
        shape: Annotated[str, typer.Option("--shape", help=f"model shape: {', '.join(SHAPES)} or a config.json path")] = "llama-3.1-8b",
        contexts: Annotated[str, typer.Option("--contexts", help="context lengths for decode, comma-separated")] = "512,4096,16384",
        compile_step: Annotated[bool, typer.Option("--compile/--no-compile", help="also time the torch.compile'd step")] = True,
        hardware: Annotated[Optional[str], typer.Option("--hardware", help="catalogue id whose tensor peak prefill is judged against")] = None,
        peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="dense fp16/bf16 tensor peak (overrides --hardware)")] = None,
        from_file: Annotated[Optional[str], typer.Option("--from", help="convert an earlier `python -m engine bench` JSON instead of measuring")] = None,
        profile_id: Annotated[str, typer.Option("--id", help="id of the written EngineProfile")] = "v100plan-measured",
        python: Annotated[str, typer.Option("--python", help="interpreter that has torch (the engine extra)")] = sys.executable,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        out: OutOpt = None,
    ) -> None:
        """Measure the engine's decode, prefill and allreduce on this GPU host; write an EngineProfile."""
        output.check_out(out)
        if from_file:
            bench = documents.read_json(from_file)
            if not isinstance(bench, dict) or bench.get("kind") != "engine_bench":
                raise BadInput(f"{from_file} is not a `python -m engine bench` result (kind engine_bench)")
        else:
            config = shape if shape.endswith(".json") else None
            if config is None:
                if shape not in SHAPES:
                    raise BadInput(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)} or a config.json path")
                config = str(Path(__file__).resolve().parents[2] / "engine" / "data" / f"{shape}.config.json")
            args = ["--config", config, "--contexts", contexts] + (["--compile"] if compile_step else [])
            peak, peak_source = peak_tflops, "given with --peak-tflops" if peak_tflops else None
            if peak is None and hardware:
                peak, peak_source = _peak_from_catalogue(hardware, "bfloat16")
            if peak is not None:
                args += ["--peak-tflops", str(peak), "--peak-source", peak_source or "given"]
            bench = run_bench(python, args, quiet)
        doc = documents.validate(engine_profile(bench, profile_id, from_file), "engine_profile")
        output.write_json(out, doc)
        if json_out:
            output.emit_json(doc)
        if not quiet:
            render(bench, doc, to_stderr=json_out)


def render(bench: dict[str, Any], doc: dict[str, Any], to_stderr: bool = False) -> None:
    read = bench["read_bw_gbps"]
    rows = []
    for variant, per_ctx in bench["decode"].items():
        if "unavailable" in per_ctx:
            rows.append((variant, "—", "—", "—", "—", per_ctx["unavailable"][:60]))
            continue
        for ctx, v in sorted(per_ctx.items(), key=lambda kv: int(kv[0])):
            rows.append((variant, ctx, f"{v['ms']:.2f}", f"{v['tok_s']:.1f}", f"{v['total_gbps']:.0f}",
                         f"{v['weight_gbps'] / read:.1%}"))
    cap = (f"weights {bench['weight_bytes'] / 1e9:.2f} GB/token; ceiling at the measured {read:.0f} GB/s: "
           f"{bench['predicted_ms_at_read_bw']:.2f} ms = {1000 / bench['predicted_ms_at_read_bw']:.0f} tok/s; "
           f"GEMV-only {bench['gemv']['ms']:.2f} ms ({bench['gemv']['weight_gbps'] / read:.1%})")
    output.render(output.table(f"Engine decode, batch 1, TP1: {bench['config']} on {bench['device']}",
                               ["variant", ("context", "right"), ("ms/token", "right"), ("tok/s", "right"),
                                ("GB/s", "right"), ("weights/read bw", "right")], rows, caption=cap),
                  to_stderr=to_stderr)
    eff = doc["efficiency"]
    output.render(output.table("EngineProfile efficiencies", ["parameter", ("value", "right"), "how"],
                               [(k, v["value"], v.get("note", "")) for k, v in eff.items()]), to_stderr=to_stderr)
    ar = doc.get("allreduce_us") or {}
    if ar:
        sizes = sorted({s for row in ar.values() for s in row if s != "unavailable"}, key=lambda s: int(s[:-1]))
        output.render(output.table("Allreduce, median us per call", ["path"] + [(s, "right") for s in sizes],
                                   [[p] + ([row.get(s) for s in sizes] if "unavailable" not in row
                                           else [row["unavailable"][:40]] + [None] * (len(sizes) - 1))
                                    for p, row in ar.items()],
                                   caption=doc.get("allreduce_source")), to_stderr=to_stderr)
