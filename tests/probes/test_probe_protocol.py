"""The case protocol: waived is never passed, one failing or hanging case never stops the others."""

from __future__ import annotations

import time

from probes.cases import Case, Outcome
from probes.context import Options, ProbeContext
from probes.report import CaseResult, overall_status
from probes.runner import run_cases


def _case(key, run, applicable=lambda ctx: None, timeout=5.0, order=0):
    return Case(key, f"{key} case", applicable, run, lambda ctx: timeout, order)


def _boom(ctx):
    raise RuntimeError("cuda error 700")


def test_errors_timeouts_and_waivers_are_contained_per_case():
    events = []
    cases = [
        _case("raises", _boom),
        _case("hangs", lambda ctx: time.sleep(30), timeout=0.3),
        _case("waived", lambda ctx: Outcome("passed"), applicable=lambda ctx: "one card"),
        _case("bad_return", lambda ctx: "ok"),
        _case("warns", lambda ctx: Outcome("warned", "hot")),
        _case("passes", lambda ctx: Outcome("passed", None, {"x": 1})),
    ]
    t0 = time.perf_counter()
    results = run_cases(cases, ProbeContext(Options.for_mode("quick")), events.append)
    assert time.perf_counter() - t0 < 5
    by_key = {r.key: r for r in results}
    assert by_key["raises"].status == "error" and "cuda error 700" in by_key["raises"].reason
    assert by_key["hangs"].status == "error" and "timeout" in by_key["hangs"].reason
    assert by_key["waived"].status == "waived" and by_key["waived"].reason == "one card"
    assert by_key["bad_return"].status == "error"
    assert by_key["warns"].status == "warned"
    assert by_key["passes"].status == "passed" and by_key["passes"].details == {"x": 1}
    assert [e["event"] for e in events] == ["start", "end"] * 6
    assert overall_status(results) == "failed"


def test_overall_status_table():
    def r(*statuses):
        return [CaseResult(f"k{i}", "d", s, None, 0.0) for i, s in enumerate(statuses)]

    assert overall_status(r("waived", "waived")) == "nothing_measured"
    assert overall_status(r()) == "nothing_measured"
    assert overall_status(r("waived", "passed")) == "passed"
    assert overall_status(r("passed", "warned", "waived")) == "warned"
    assert overall_status(r("passed", "error")) == "failed"
    assert overall_status(r("failed", "warned")) == "failed"


def test_registry_has_every_probe_with_unique_keys():
    from probes.cases import registry

    keys = [c.key for c in registry()]
    assert keys == ["inventory", "software_stack", "bandwidth", "p2p", "cuda_ipc", "throttle"]
