"""`v100plan bench tp2`: two GPUs measured (or a recorded run judged): allreduce paths, the start-up race,
TP2 vs TP1 decode, the EngineProfile those numbers give, and the planner's prediction against them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from profiles.document import SCHEMA_VERSIONS, provenance
from v100plan import catalogue, documents, output
from v100plan.calibrate import tp2_compare, tp2_profile, views
from v100plan.calibrate.single import peak_from_catalogue
from v100plan.errors import EnvironmentProblem, NothingMeasured
from v100plan.options import JsonOpt, OutOpt, QuietOpt

REPO = Path(__file__).resolve().parent.parent.parent
FromOpt = Annotated[Optional[Path], typer.Option("--from", help="Judge a recorded `python -m engine bench-tp2` JSON instead of measuring (default: measure now).")]
ProbeOpt = Annotated[Optional[Path], typer.Option("--probe", help="A ProbeReport of the same host: its read bandwidth and pair view feed the plan (default: the bench's own read bandwidth and the catalogue card).")]
ProfileOutOpt = Annotated[Optional[Path], typer.Option("--profile-out", help="Write the measured EngineProfile (CUDA-graph decode, TP2 fractions fitted at the two shortest contexts) here (default: not written).")]
ModelOpt = Annotated[Optional[Path], typer.Option("--model-profile", help="ModelProfile of the bench's shape when the catalogue has none (default: the catalogue's model for the bench's config).")]
ContextsOpt = Annotated[str, typer.Option("--contexts", help="Decode contexts in tokens, comma-separated (measuring only).")]
HardwareOpt = Annotated[Optional[str], typer.Option(
    "--hardware", help="Catalogue id of the two cards: its bf16 tensor peak judges prefill, and the comparison plans on "
                       "it. Default: the card --probe identifies, else the bench's recorded device name.")]


def run_bench(contexts: str, card_id: str | None) -> dict[str, Any]:
    """`python -m engine bench-tp2` in a subprocess (the engine bundle, as on a GPU host). The tensor peak comes
    from the catalogue profile of ``card_id``; without one, prefill's fraction stays null with the reason."""
    cmd = [sys.executable, "-m", "engine", "bench-tp2", "--contexts", contexts]
    if card_id:
        peak, source = peak_from_catalogue(card_id, "bfloat16")
        if peak is not None:
            cmd += ["--peak-tflops", str(peak), "--peak-source", source or f"catalogue {card_id}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError:
        raise EnvironmentProblem(f"the engine bench printed no JSON (exit {r.returncode}): {r.stderr[-400:]}",
                                 hint="run `python -m engine bench-tp2` by hand on the GPU host") from None
    if doc.get("error"):
        raise EnvironmentProblem(f"engine bench: {doc['error']}", hint="run on a host with two NVIDIA GPUs")
    return doc


def load_bench(path: Path) -> dict[str, Any]:
    doc = documents.read_json(path)
    documents.expect_kind(doc, ("engine_bench_tp2",), str(path), required=True,
                          hint="give the JSON `python -m engine bench-tp2` printed")
    return doc


def _us(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "—"


def _ms(v: Any) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "—"


def render(bench: dict[str, Any], cmp: dict[str, Any], to_stderr: bool) -> None:
    sizes = bench.get("sizes", [])
    rows = []
    for path, row in bench.get("allreduce", {}).items():
        if "eager_us" not in row:
            rows.append((path, "—", *["—"] * len(sizes), row.get("unavailable") or row.get("error")))
            continue
        exact = "bit-exact" if all(row["bit_exact"].values()) else "NOT bit-exact"
        rows.append((path, "eager", *[_us(row["eager_us"].get(s)) for s in sizes], exact))
        g = row.get("graph_us") or {}
        rows.append((path, "graph", *[_us(g.get(s)) for s in sizes], "not capturable" if "unavailable" in g else exact))
    output.render(output.table("Allreduce between the two GPUs (median us)", ["path", "mode", *[(s, "right") for s in sizes], "check"],
                               rows), to_stderr=to_stderr)
    race = bench.get("race") or {}
    judged = race.get("judged") or {}
    if race:
        output.render(output.table(
            "Start-up race (--allreduce auto)", ["picked", "why", "fastest at 8k", "fastest at 40k"],
            [(race.get("picked"), race.get("why") or race.get("error"),
              *[(f"{j['fastest']} ({_us(j['fastest_us'])} us)" if (j := judged.get(k)) else "—") for k in ("8k", "40k")])]),
            to_stderr=to_stderr)
    tp1 = ((bench.get("tp1") or {}).get("rank0") or {})
    tp2 = bench.get("tp2") or {}
    cols = [("TP1", "graph", tp1)] + [(f"TP2 {p}", "graph", t) for p, t in tp2.items() if "decode_graph" in t]
    cols += [("TP1", "eager", tp1)] + [(f"TP2 {p}", "eager", t) for p, t in tp2.items() if "decode_eager" in t]
    drows = [(ctx, *[_us(((t.get(f"decode_{mode}") or {}).get(ctx) or {}).get("ms")) for _, mode, t in cols])
             for ctx in map(str, bench.get("contexts", []))]
    output.render(output.table(
        "Decode step, batch 1 (ms; graph = whole step in one CUDA graph; eager = step by step)",
        ["context", *[(f"{name} {mode}", "right") for name, mode, _ in cols]], drows), to_stderr=to_stderr)
    prow = [(r["hardware"], r["mode"], r["context"], r["strategy"], r["path"] or "—", _ms(r["predicted_ms"]),
             _ms(r["measured_ms"]), f"{r['error_pct']:+.1f} %" if r["error_pct"] is not None else "—", r.get("role") or "—")
            for r in cmp.get("rows", []) if r["chosen_by"] == "planner"]
    output.render(output.table(
        f"Planner prediction vs measured ({cmp.get('model') or cmp.get('unavailable')}; role: did this measurement "
        "set the profile, or is it held out)",
        ["hardware", "mode", ("context", "right"), "strategy", "path", ("predicted ms", "right"), ("measured ms", "right"),
         ("error", "right"), "role"], prow), to_stderr=to_stderr)


def register(app: typer.Typer) -> None:
    @app.command("tp2")
    def bench_tp2(
        from_file: FromOpt = None,
        probe: ProbeOpt = None,
        profile_out: ProfileOutOpt = None,
        model_profile: ModelOpt = None,
        contexts: ContextsOpt = "1024,4096,16384,32768",
        hardware: HardwareOpt = None,
        json_out: JsonOpt = False,
        quiet: QuietOpt = False,
        out: OutOpt = None,
    ) -> None:
        """Two GPUs: allreduce paths, the start-up race, TP2 vs TP1 decode, and the planner's TP2 prediction checked."""
        output.check_out(out)
        output.check_out(profile_out, "--profile-out")
        if hardware is not None and hardware not in catalogue.ids("hardware"):
            catalogue.get("hardware", hardware)  # raises UnknownId with the valid ids
        probe_doc = documents.load(probe, "probe_report") if probe else None
        model_doc = documents.load(model_profile, "model_profile") if model_profile else None
        card_id = hardware or (views.card_id_for({}, probe_doc) if probe_doc else None)
        bench = load_bench(from_file) if from_file else run_bench(contexts, card_id)
        bench_source = str(from_file) if from_file else "python -m engine bench-tp2 (this run)"
        card_id = card_id or views.card_id_for(bench, probe_doc)
        try:
            engines = {mode: tp2_profile.engine_profile(bench, probe_doc, bench_source=bench_source,
                                                        probe_source=str(probe) if probe else None, mode=mode,
                                                        model_doc=model_doc, card_id=card_id)
                       for mode in ("graph", "eager")}
        except tp2_profile.BenchProblem as e:
            raise NothingMeasured(f"{bench_source}: {e}", hint="the bench's JSON says which phase failed") from None
        for mode, doc in engines.items():
            documents.validate(doc, "engine_profile", source=f"engine profile ({mode}) built from {bench_source}")
        cmp = tp2_compare.comparison(bench, engines, probe_doc, str(probe) if probe else None, model_doc, card_id)
        output.write_json(profile_out, engines["graph"], "--profile-out")
        doc = {"kind": "tp2_bench", "schema_version": SCHEMA_VERSIONS["tp2_bench"],
               "provenance": provenance({"bench": bench_source, "probe_report": str(probe) if probe else None,
                                         "hardware": card_id}),
               "bench": bench_source, "probe_report": str(probe) if probe else None, "race": bench.get("race"),
               "engine_profiles": engines, "comparison": cmp}
        documents.validate(doc, "tp2_bench", source="bench tp2")
        output.write_json(out, doc, indent=1)
        if json_out:
            output.emit_json(doc)
        if not quiet:
            render(bench, cmp, to_stderr=json_out)
