"""An EngineProfile from a two-GPU bench (`python -m engine bench-tp2`), for the planner.

The efficiencies come from card 0 running the whole model alone (TP1), so the planner's TP2
figure is a prediction, not a fit:
  weight_bw_fraction  = weight bytes / GEMV-only step time / read bandwidth
  kv_bw_fraction      = (1 / slope of step time over K/V bytes) / read bandwidth
  round_overhead_ms   = intercept of that line - GEMV-only time (norms, rotary, softmax, launches)
  prefill_compute_fraction = a 2048-token chunk's FLOP/s / the card's dense bf16 tensor peak
  allreduce_us        = per path and size: in a CUDA graph where the path can be captured (NCCL),
                        else eager (the mailboxes wait on the host)
  tp2_*_bw_fraction   = fitted on the TP2 CUDA-graph step at the two shortest contexts only, the longer
                        ones held out to test them (tp2_fit.py)
The arithmetic is the one-GPU builder's (single.py), fed card 0's TP1 figures.
The read bandwidth is the probe report's slowest card when one is given (what `v100plan plan --hardware
<probe report>` divides by), else the bench's own sum over 4 GiB.

``mode="eager"`` describes the same engine run step by step without a graph (how the ranks run today):
its round overhead adds the measured eager-minus-graph difference of TP1, and every path's allreduce
figure is its eager one.
"""

from __future__ import annotations

from typing import Any

from v100plan import catalogue
from v100plan.calibrate import single, tp2_fit, views
from v100plan.calibrate.fit import BenchProblem, line_fit
from v100plan.calibrate.single import PATH_NAMES  # the engine's --allreduce names

GRAPH_PATH = "nccl"  # the one engine path the bench captures in a CUDA graph

__all__ = ["BenchProblem", "engine_profile", "line_fit"]


def read_bw(bench: dict[str, Any], probe: dict[str, Any] | None) -> tuple[float, str]:
    """(GB/s, where from): the probe's slowest measured card, else the bench's slowest card."""
    if probe:
        got = [c["read_bw_gbps"] for c in probe.get("cards", []) if c.get("read_bw_gbps")]
        if got:
            return min(got), "probe report (cupy read kernel), slowest card"
    got = [b for b in bench.get("read_bw_gbps") or [] if b]
    if not got:
        raise BenchProblem("the bench has no read bandwidth and no probe report was given")
    return min(got), "bench (torch sum over 4 GiB), slowest card"


def tp1_terms(bench: dict[str, Any]) -> dict[str, Any]:
    """Card 0's TP1 figures: GEMV ms, the line through (K/V bytes, step ms), the eager extra."""
    tp1 = (bench.get("tp1") or {}).get("rank0") or {}
    if "gemv" not in tp1 or "decode_graph" not in tp1:
        raise BenchProblem(f"the bench has no TP1 graph decode on card 0 ({tp1.get('error', 'phase missing')})")
    dec = tp1["decode_graph"]
    intercept, slope = line_fit([(v["kv_bytes"], v["ms"]) for v in dec.values()])  # ms, ms per byte
    eager = tp1.get("decode_eager") or {}
    extra = [eager[c]["ms"] - dec[c]["ms"] for c in dec if c in eager]
    return {"gemv_ms": tp1["gemv"]["ms"], "weight_bytes": tp1["gemv"]["weight_bytes"], "intercept_ms": intercept,
            "slope_ms_per_byte": slope, "eager_extra_ms": sum(extra) / len(extra) if extra else None,
            "prefill": tp1.get("prefill") or {}, "contexts": sorted(int(c) for c in dec)}


def allreduce_tables(bench: dict[str, Any], mode: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for path, row in (bench.get("allreduce") or {}).items():
        if path not in PATH_NAMES:
            continue  # experimental paths (device_mailbox_graph) are no engine flag: compared separately
        if not isinstance(row, dict) or "eager_us" not in row:
            out[path] = {"unavailable": str((row or {}).get("unavailable") or (row or {}).get("error") or "not measured")}
            continue
        if not all(row.get("bit_exact", {}).values()):
            out[path] = {"unavailable": "the bench's bit-exact check failed on this path"}
            continue
        graph = row.get("graph_us") if isinstance(row.get("graph_us"), dict) else {}
        use_graph = mode == "graph" and path == GRAPH_PATH and "unavailable" not in graph
        out[path] = dict(graph if use_graph else row["eager_us"])
    return out


def single_gpu_view(bench: dict[str, Any], bw: float, bw_from: str, cc: str | None = None) -> dict[str, Any]:
    """Card 0's TP1 figures in the shape of a `python -m engine bench` result, so the one-GPU EngineProfile
    builder (single.py) reads them; the fit is redone against ``bw`` (the planner's bandwidth)."""
    t = tp1_terms(bench)
    tp1 = bench["tp1"]["rank0"]
    kv_gbps = 1 / (t["slope_ms_per_byte"] * 1e-3) / 1e9 if t["slope_ms_per_byte"] > 0 else None
    fit = {"intercept_ms": round(t["intercept_ms"], 4), "kv_gbps": round(kv_gbps, 1) if kv_gbps else None,
           "kv_bw_fraction": round(kv_gbps / bw, 4) if kv_gbps else None,
           "round_overhead_ms": round(t["intercept_ms"] - t["gemv_ms"], 4)}
    card = (bench.get("cards") or [{}])[0] or {}
    return {"device": f"{card.get('device', 'GPU')} x 2, card 0", "compute_capability": cc or bench.get("compute_capability") or "not recorded",
            "torch": bench.get("torch"), "cuda": bench.get("cuda"), "config": bench.get("config"), "dtype": bench.get("dtype"),
            "created_utc": bench.get("created_utc", ""), "method": bench.get("method"),
            "read_bw_gbps": round(bw, 1), "read_bw_from": bw_from, "gemv": tp1["gemv"],
            "decode": {"graph": tp1["decode_graph"]}, "fit": {"graph": fit}, "prefill": tp1.get("prefill") or {},
            "peak_tflops": bench.get("peak_tflops"), "peak_source": bench.get("peak_source")}


def engine_profile(bench: dict[str, Any], probe: dict[str, Any] | None = None, *, bench_source: str,
                   probe_source: str | None = None, mode: str = "graph", model_doc: dict[str, Any] | None = None,
                   tp2_contexts: list[int] | None = None, card_id: str | None = None) -> dict[str, Any]:
    """The EngineProfile document (schema engine_profile) these measurements describe: the TP1
    efficiencies through the one-GPU builder, this bench's allreduce figures, and the TP2 fractions
    fitted on the TP2 CUDA-graph step at ``tp2_contexts`` only (default the two shortest; see
    tp2_fit.py). ``model_doc``: the ModelProfile of the bench's shape (default: the catalogue's, when it
    has one). The eager profile takes the graph fit: same kernels, the host's time is in its overhead.
    ``card_id``: the catalogued card the fit plans on without a probe report (default: the bench's device)."""
    doc = _measured_profile(bench, probe, bench_source=bench_source, probe_source=probe_source, mode=mode)
    if model_doc is None and (model_id := views.model_id_for(bench)):
        model_doc = catalogue.get("model", model_id)
    if model_doc is None:
        return doc  # no shape to fit against: the plan notes that the one-card fractions stand in
    graph = doc if mode == "graph" else _measured_profile(bench, probe, bench_source=bench_source,
                                                          probe_source=probe_source, mode="graph")
    contexts = tp2_contexts or tp2_fit.default_contexts(bench)
    try:
        hw = views.hardware(probe, probe_source, card_id or views.card_id_for(bench, probe))
        result = tp2_fit.fit(bench, graph, hw, model_doc, contexts)
    except (tp2_fit.CalibrationProblem, BenchProblem) as e:
        for key in ("tp2_weight_bw_fraction", "tp2_kv_bw_fraction"):
            doc["efficiency"][key] = {"value": None, "source": f"not calibrated from {bench_source}: {e}"}
        return doc
    return tp2_fit.apply(doc, result, bench_source)


def _measured_profile(bench: dict[str, Any], probe: dict[str, Any] | None, *, bench_source: str,
                      probe_source: str | None, mode: str) -> dict[str, Any]:
    """The profile without TP2 fractions: TP1 efficiencies and this bench's allreduce figures."""
    if mode not in ("graph", "eager"):
        raise BenchProblem(f"mode must be graph or eager, got {mode!r}")
    bw, bw_from = read_bw(bench, probe)
    t = tp1_terms(bench)
    cc = ((probe or {}).get("cards") or [{}])[0].get("compute_capability")
    view = single_gpu_view(bench, bw, bw_from, cc)
    doc = single.engine_profile(view, profile_id=f"v100plan-{mode}-measured", bench_file=bench_source)
    doc["provenance"]["inputs"].update({"probe_report": probe_source, "mode": mode, "read_bw_from": bw_from})
    doc["provenance"]["nccl"] = bench.get("nccl")
    eff = doc["efficiency"]
    if mode == "eager":
        if t["eager_extra_ms"] is None:
            raise BenchProblem("the bench has no TP1 eager decode on card 0")
        o = eff["round_overhead_ms"]
        o["note"] += f"; eager: + {t['eager_extra_ms']:.4f} ms, TP1 eager minus graph step, mean over the contexts"
        o["value"] = round(o["value"] + t["eager_extra_ms"], 4)
    tables = allreduce_tables(bench, mode)
    ar_mode = ("NCCL inside a CUDA graph (as the graph-captured decode step runs it), the mailboxes eager"
               if mode == "graph" else "every path eager, synchronised per call (as an eager step runs it)")
    step = "eager decode" if mode == "eager" else "CUDA-graph decode"
    doc["name"] = f"v100plan engine, {step}, measured on two {view['device'].split(' x ')[0]}"
    doc["description"] = (f"{doc['description']} Read bandwidth: {bw_from}. Step: {step}. Allreduce figures from "
                          f"`python -m engine bench-tp2`, one process per GPU: {ar_mode}.")
    doc["allreduce_paths"] = [p for p in tables if "unavailable" not in tables[p] and p != "gloo"]
    doc["allreduce_us"] = tables
    doc["allreduce_source"] = f"measured: {bench_source} ({bench.get('created_utc', '')[:10]}), two GPUs: {ar_mode}"
    return doc
