"""Freeze what the cases found (ProbeContext) into a ProbeReport."""

from __future__ import annotations

import dataclasses

from profiles.document import provenance

from probes.context import ProbeContext
from probes.report import Card, CaseResult, Host, Pair, ProbeReport, Throttle, overall_status


def _why_missing(results: list[CaseResult], key: str) -> str:
    r = next((c for c in results if c.key == key), None)
    if r is None:
        return f"the {key} case was not run (not selected)"
    if r.status in ("waived", "error"):
        return f"the {key} case was {r.status}: {r.reason}"
    return f"not reported by the {key} case"


# Which case fills which card field, so an empty field names the case that would have filled it.
_FIELD_CASE = {"read_bw_gbps": "bandwidth", "copy_bw_gbps": "bandwidth", "bandwidth": "bandwidth",
               "sm_count": "bandwidth", "l2_cache_mib": "bandwidth", "nccl_supported": "software_stack",
               "torch_supported": "software_stack", "cupy_supported": "software_stack", "throttle": "throttle"}


def build(ctx: ProbeContext, results: list[CaseResult], wall_s: float) -> ProbeReport:
    card_fields = {f.name for f in dataclasses.fields(Card)}
    cards = []
    for state in ctx.cards:
        values = {k: v for k, v in state.values.items() if k in card_fields}
        values.setdefault("name", f"card {state.index}")
        if values["name"] is None:
            values["name"] = f"card {state.index}"
        unavailable = dict(state.unavailable)
        for field, key in _FIELD_CASE.items():
            if values.get(field) is None and field not in unavailable:
                unavailable[field] = _why_missing(results, key)
        unavailable.setdefault("variant_id", "matched against the catalogue by the control plane (v100plan probe)")
        throttle = values.pop("throttle", None) or Throttle(
            explanation=_why_missing(results, "throttle"), unavailable={"sm_clock_median_mhz": _why_missing(results, "throttle")})
        unavailable.pop("throttle", None)
        values.pop("index", None)
        cards.append(Card(index=state.index, **values, throttle=throttle, unavailable=unavailable))
    pairs = []
    pair_fields = {f.name for f in dataclasses.fields(Pair)}
    for (s, d), raw in sorted(ctx.pairs.items()):
        values = {k: v for k, v in raw.items() if k in pair_fields}
        pairs.append(Pair(**values))
    host_fields = {f.name for f in dataclasses.fields(Host)}
    host_values = {k: v for k, v in ctx.host.items() if k in host_fields}
    host_unavailable = dict(ctx.host_unavailable)
    if ctx.nvml_problem:
        for f in ("driver_version", "cuda_driver_version"):
            host_unavailable.setdefault(f, ctx.nvml_problem)
    for f in ("nccl_version", "nccl_archs", "torch_version", "torch_cuda_version", "torch_arch_list",
              "cupy_version", "cupy_cuda_version", "nvrtc_archs", "nccl_library", "stack_verdict"):
        if host_values.get(f) is None:
            host_unavailable.setdefault(f, _why_missing(results, "software_stack"))
    if host_values.get("xid_events") is None:
        host_unavailable.setdefault("xid_events", _why_missing(results, "inventory"))
    host = Host(**host_values, unavailable=host_unavailable)
    prov = provenance(
        {"mode": ctx.options.mode, "load_duration_s": ctx.options.load_duration_s,
         "min_load_s": ctx.options.min_load_s, "sample_hz": ctx.options.sample_hz, "only": list(ctx.options.only)},
        driver=host.driver_version, cuda=host.cuda_driver_version, nccl=host.nccl_version,
        torch=host.torch_version, method=dict(ctx.method),
    )
    return ProbeReport(provenance=prov, host=host, cards=cards, pairs=pairs, cases=results,
                       overall=overall_status(results), wall_s=round(wall_s, 2))
