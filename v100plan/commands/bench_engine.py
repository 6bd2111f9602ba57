"""`v100plan bench engine`: run the engine benchmark on this GPU host (`python -m engine bench` as a
subprocess) and turn its measurements into an EngineProfile the planner reads (v100plan/calibrate/single.py
says how each efficiency is derived).
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

from v100plan import documents, output
from v100plan.calibrate.fit import BenchProblem
from v100plan.calibrate.single import engine_profile, peak_from_catalogue
from v100plan.errors import BadInput, EnvironmentProblem
from v100plan.options import JsonOpt, OutOpt, QuietOpt

SHAPES = ("llama-3.1-8b", "qwen3-8b")


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
        hardware: Annotated[Optional[str], typer.Option("--hardware", help="catalogue id whose tensor peak prefill is judged against (default: none, the prefill fraction stays null with the reason)")] = None,
        peak_tflops: Annotated[Optional[float], typer.Option("--peak-tflops", help="dense fp16/bf16 tensor peak in TFLOP/s; overrides --hardware (default: the --hardware profile's)")] = None,
        from_file: Annotated[Optional[str], typer.Option("--from", help="convert an earlier `python -m engine bench` JSON instead of measuring (default: measure now)")] = None,
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
            documents.expect_kind(bench, ("engine_bench",), from_file, required=True,
                                  hint="give the JSON `python -m engine bench --out FILE` wrote")
        else:
            config = shape if shape.endswith(".json") else None
            if config is None:
                if shape not in SHAPES:
                    raise BadInput(f"unknown shape {shape!r}; valid: {', '.join(SHAPES)} or a config.json path",
                                   hint="e.g. --shape llama-3.1-8b, or --shape path/to/config.json")
                config = str(Path(__file__).resolve().parents[2] / "engine" / "data" / f"{shape}.config.json")
            args = ["--config", config, "--contexts", contexts]
            peak, peak_source = peak_tflops, "given with --peak-tflops" if peak_tflops else None
            if peak is None and hardware:
                peak, peak_source = peak_from_catalogue(hardware, "bfloat16")
            if peak is not None:
                args += ["--peak-tflops", str(peak), "--peak-source", peak_source or "given"]
            bench = run_bench(python, args, quiet)
        try:
            doc = documents.validate(engine_profile(bench, profile_id, from_file), "engine_profile")
        except BenchProblem as e:
            raise BadInput(f"{from_file or 'the engine benchmark'}: {e}", hint="run the bench with two or more --contexts") from None
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
