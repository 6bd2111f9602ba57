"""An EngineProfile from a two-GPU bench (`python -m engine bench-tp2`), for the planner.

The efficiencies come from card 0 running the whole model alone (TP1), so the planner's TP2
figure is a prediction, not a fit:
  weight_bw_fraction  = weight bytes / GEMV-only step time / read bandwidth
  kv_bw_fraction      = (1 / slope of step time over K/V bytes) / read bandwidth
  round_overhead_ms   = intercept of that line - GEMV-only time (norms, rotary, softmax, launches)
  prefill_compute_fraction = a 2048-token chunk's FLOP/s / the card's dense bf16 tensor peak
  allreduce_us        = per path and size: in a CUDA graph where the path can be captured (NCCL),
                        else eager (the mailboxes wait on the host)
The read bandwidth is the probe report's slowest card when one is given (what `v100plan plan --hardware
<probe report>` divides by), else the bench's own sum over 4 GiB.

``mode="eager"`` describes the same engine run step by step without a graph (how the ranks run today):
its round overhead adds the measured eager-minus-graph difference of TP1, and every path's allreduce
figure is its eager one.
"""

from __future__ import annotations

from typing import Any

from profiles.document import SCHEMA_VERSIONS, provenance

GRAPH_PATH = "nccl"  # the one path the bench captures in a CUDA graph


class BenchProblem(ValueError):
    """A bench document that lacks what a profile needs, with what is missing."""


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = intercept + slope x over (x, y) points: (intercept, slope)."""
    if len(points) < 2:
        raise BenchProblem("a fit over contexts needs two or more decode contexts")
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return my - slope * mx, slope


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


def engine_profile(bench: dict[str, Any], probe: dict[str, Any] | None = None, *, bench_source: str,
                   probe_source: str | None = None, mode: str = "graph",
                   peak_tflops: float | None = None, peak_source: str | None = None) -> dict[str, Any]:
    """The EngineProfile document (schema engine_profile) these measurements describe."""
    if mode not in ("graph", "eager"):
        raise BenchProblem(f"mode must be graph or eager, got {mode!r}")
    bw, bw_from = read_bw(bench, probe)
    t = tp1_terms(bench)
    where = f"measurement, {bench_source} ({bench.get('created_utc', 'undated')[:10]}, card 0, TP1)"
    weight_gbps = t["weight_bytes"] / (t["gemv_ms"] * 1e-3) / 1e9
    kv_gbps = 1 / (t["slope_ms_per_byte"] * 1e-3) / 1e9 if t["slope_ms_per_byte"] > 0 else None
    overhead = t["intercept_ms"] - t["gemv_ms"]
    calibration = [
        {"key": "weights", "figure": f"GEMV-only step {t['gemv_ms']:.3f} ms for {t['weight_bytes']:,} B",
         "parameter": "weight_bw_fraction",
         "arithmetic": f"{weight_gbps:.1f} GB/s / {bw:.1f} GB/s ({bw_from}) = {weight_gbps / bw:.4f}"},
        {"key": "kv_and_overhead", "figure": f"TP1 graph decode at {', '.join(map(str, t['contexts']))} tokens",
         "parameter": "kv_bw_fraction, round_overhead_ms",
         "arithmetic": (f"least squares step ms = {t['intercept_ms']:.4f} + {t['slope_ms_per_byte'] * 1e9:.4f} ms/GB"
                        f" x K/V GB; K/V {kv_gbps or 0:.1f} GB/s / {bw:.1f} = {(kv_gbps or 0) / bw:.4f}; overhead "
                        f"{t['intercept_ms']:.4f} - {t['gemv_ms']:.4f} = {overhead:.4f} ms")},
    ]
    if mode == "eager":
        if t["eager_extra_ms"] is None:
            raise BenchProblem("the bench has no TP1 eager decode on card 0")
        calibration.append({"key": "eager", "figure": "TP1 eager minus graph step, mean over the contexts",
                            "parameter": "round_overhead_ms",
                            "arithmetic": f"{overhead:.4f} + {t['eager_extra_ms']:.4f} = {overhead + t['eager_extra_ms']:.4f} ms"})
        overhead += t["eager_extra_ms"]
    pf = t["prefill"]
    peak = peak_tflops or bench.get("peak_tflops")
    pf_value = round(pf["tflops"] / peak, 4) if pf.get("tflops") and peak else None
    pf_source = (f"{where}: {pf['tokens']}-token chunk {pf['tflops']} TFLOP/s / {peak} TFLOPS "
                 f"({peak_source or bench.get('peak_source') or 'peak given to the bench'})"
                 if pf_value else "not measured: the bench had no prefill chunk or no peak")
    tables = allreduce_tables(bench, mode)
    ar_mode = ("NCCL inside a CUDA graph (as the graph-captured decode step runs it), the mailboxes eager"
               if mode == "graph" else "every path eager, synchronised per call (as an eager step runs it)")
    eager_word = "eager decode" if mode == "eager" else "CUDA-graph decode"
    return {
        "kind": "engine_profile",
        "schema_version": SCHEMA_VERSIONS["engine_profile"],
        "provenance": provenance(
            {"bench": bench_source, "probe_report": probe_source, "mode": mode},
            torch=bench.get("torch"), cuda=bench.get("cuda"), nccl=bench.get("nccl"),
            method=bench.get("method"), measured_utc=bench.get("created_utc")),
        "id": f"v100plan-{mode}-measured",
        "name": f"v100plan bundled engine, {eager_word}, measured on two {(bench.get('cards') or [{}])[0].get('device', 'GPUs')}",
        "description": (f"Efficiencies of python -m engine's {eager_word} measured by `python -m engine bench-tp2` "
                        f"({bench.get('dtype')}, {bench.get('config')}); allreduce figures: {ar_mode}."),
        "status": "measured",
        "efficiency": {
            "weight_bw_fraction": {"value": round(weight_gbps / bw, 4), "source": where},
            "kv_bw_fraction": {"value": round(kv_gbps / bw, 4) if kv_gbps else None,
                               "source": where if kv_gbps else "the decode time did not rise with context"},
            "round_overhead_ms": {"value": round(overhead, 4), "source": where},
            "prefill_compute_fraction": {"value": pf_value, "source": pf_source},
        },
        "prefill_chunk_tokens": pf.get("tokens", 2048),
        "speculative": {"draft_tokens": 0, "default_acceptance": 0.0, "source": "the bundled engine does not speculate"},
        "allreduce_paths": [p for p in tables if "unavailable" not in tables[p] and p != "gloo"],
        "allreduce_us": tables,
        "allreduce_source": f"{where.replace(', TP1', '')}: two processes, one per GPU; {ar_mode}",
        "calibration": calibration,
    }
