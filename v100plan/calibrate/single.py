"""`python -m engine bench` (one GPU) -> EngineProfile, the document the planner reads.

How each efficiency is derived from the bench JSON (engine/bench/decode.py says how each is measured):
  weight_bw_fraction        GEMV-only GB/s (every weight matrix once, batch 1, one CUDA graph) / read GB/s
  kv_bw_fraction            1 / slope of step time over K/V bytes read, / read GB/s
  round_overhead_ms         intercept of that line minus the GEMV-only time: what a round costs beyond bytes
  prefill_compute_fraction  achieved TFLOP/s on a 2048-token chunk / the card's dense fp16/bf16 tensor peak
                            (the peak from the catalogue's hardware profile, with its source)
The decode variant used is the fastest one measured (the compiled step when torch.compile ran).
"""

from __future__ import annotations

import json
from typing import Any

from profiles.document import SCHEMA_VERSIONS, provenance
from v100plan import catalogue
from v100plan.calibrate.fit import BenchProblem

PATH_NAMES = ("nccl", "gloo", "host_mailbox", "device_mailbox")


def best_variant(bench: dict[str, Any]) -> str:
    """The fastest decode variant (shortest step at the smallest context all of them measured) among
    those whose step time grew with the context, so their line through the points means something."""
    variants = {k: v for k, v in bench["decode"].items()
                if "unavailable" not in v and (bench["fit"].get(k) or {}).get("kv_bw_fraction")}
    if not variants:
        raise BenchProblem("no decode variant in this bench has a usable fit (two or more contexts, time "
                           "growing with context): run the bench with more than one context")
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
    if prefill and "tflops" not in prefill:  # one row per prompt length: the shortest (one chunk, as before)
        prefill = prefill[min(prefill, key=int)]
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


def peak_from_catalogue(hardware: str, dtype: str) -> tuple[float | None, str | None]:
    """The card's dense tensor peak for ``dtype`` and its source, from the catalogue only (None: not catalogued)."""
    hw = catalogue.get("hardware", hardware)
    key = "bf16_tensor_tflops" if dtype == "bfloat16" else "fp16_tensor_tflops"
    value = hw.get(key)
    if value is None:
        return None, None
    source = (hw.get("sources") or {}).get(key) or f"catalogue {hardware}.{key}"
    return float(value), source if isinstance(source, str) else json.dumps(source)
