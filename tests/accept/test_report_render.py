"""The acceptance report's renderers (v100plan/report/): HTML with inline SVG plots and JUnit XML.

Run over every AcceptanceReport in tests/fixtures/acceptance/ (the renderer samples
built by make_sample.py around the real two-H200 probe recording and a real plan,
and any recorded qualify output placed there), plus targeted variants of them.
"""

from __future__ import annotations

import copy
import json
import os
import re
import stat
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tests import golden_files
from tests.conftest import FIXTURES
from v100plan.errors import BadInput, DocumentError
from v100plan.report import render_html, render_junit, write_reports
from v100plan.report.plots import plot_names
from v100plan.report.svg import fmt
from v100plan.report.write import validate_report

ACCEPTANCE = FIXTURES / "acceptance"
GOLDEN = ACCEPTANCE / "golden"
REPORTS = sorted(ACCEPTANCE.glob("*.json"))
STATUSES = ("passed", "warned", "failed", "waived", "error")


def _load(name: str) -> dict:
    return json.loads((ACCEPTANCE / name).read_text())


@pytest.fixture(params=REPORTS, ids=[p.name for p in REPORTS])
def report(request) -> dict:
    return json.loads(request.param.read_text())


class _Elements(HTMLParser):
    """Every start tag with its attributes, and the page's visible text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        self._in_style = False

    def handle_data(self, data):
        if not self._in_style:
            self.text.append(data)


def _parse(page: str) -> _Elements:
    p = _Elements()
    p.feed(page)
    p.close()
    return p


def _svg(page: str, name: str) -> str:
    found = re.findall(r'<svg data-plot="' + re.escape(name) + r'".*?</svg>', page, flags=re.S)
    assert len(found) == 1, f"expected one data-plot={name!r}, found {len(found)}"
    return found[0]


def _junit(report: dict) -> ET.Element:
    return ET.fromstring(render_junit(report).encode())


# --- every fixture ----------------------------------------------------------------------------------------


def test_fixtures_exist_and_are_valid_documents():
    assert {p.name for p in REPORTS} >= {"sample-report.json", "sample-failed-partial.json"}
    for path in REPORTS:
        validate_report(json.loads(path.read_text()), source=path.name)


def test_every_scenario_appears_with_its_status(report):
    page = render_html(report)
    rows = re.findall(r"<tr><td><b>(.*?)</b>.*?<span class=\"status s-(\w+)\">", page, flags=re.S)
    assert rows == [(s["key"], s["status"]) for s in report["scenarios"]]


def test_verdict_comes_first_with_its_reason(report):
    page = render_html(report)
    verdict = page.index(f'data-verdict="{report["verdict"]}"')
    assert verdict < page.index("<h2>")
    assert f'verdict-{report["verdict"]}' in page
    assert render_html({**report, "verdict_reason": "R&D said <no>"}).count("R&amp;D said &lt;no&gt;") == 1


def test_every_plot_is_present_once_and_drawn_or_marked_not_measured(report):
    page = render_html(report)
    for name in plot_names(report):
        svg = _svg(page, name)
        if 'class="plot not-measured"' in svg:
            assert "not measured: " in svg and "not-measured-box" in svg
        else:
            drawn = re.findall(r"<(rect|line|polyline|circle)\b", svg)
            assert len(drawn) > 5, f"{name} draws almost nothing"
            assert "not measured:" not in svg


def test_page_is_self_contained(report):
    page = render_html(report)
    tags = _parse(page).tags
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe", "object", "embed")]
    csp = [a["content"] for t, a in tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert csp and "default-src 'none'" in csp[0]
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", page)


def test_junit_counts_equal_the_summary(report):
    root = _junit(report)
    s = report["summary"]
    stopped = int(report["partial"])  # a run that stopped early is one more errored test case
    assert root.tag == "testsuites"
    assert int(root.get("tests")) == sum(s.values()) + stopped == len(report["scenarios"]) + stopped
    assert int(root.get("failures")) == s["failed"]
    assert int(root.get("errors")) == s["error"] + stopped
    assert int(root.get("skipped")) == s["waived"]
    suites = root.findall("testsuite")
    assert [x.get("name") for x in suites] == [f"v100plan.accept.{g}" for g in ("functional", "fault", "load")] \
        + ["v100plan.accept.run"] * stopped
    for suite in suites:
        assert int(suite.get("tests")) == len(suite.findall("testcase"))
        assert int(suite.get("failures")) == len(suite.findall("testcase/failure"))
        assert int(suite.get("errors")) == len(suite.findall("testcase/error"))
        assert int(suite.get("skipped")) == len(suite.findall("testcase/skipped"))
        props = {p.get("name"): p.get("value") for p in suite.findall("properties/property")}
        assert props["verdict"] == report["verdict"]
        assert props["target.endpoint"] == report["target"]["endpoint"]
        assert props["partial"] == str(report["partial"]).lower()


def test_junit_statuses_map_to_elements(report):
    root = _junit(report)
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert len(cases) == len(report["scenarios"]) + int(report["partial"])
    for s in report["scenarios"]:
        case = cases[(f"v100plan.accept.{s['group']}", s["key"])]
        children = {c.tag for c in case} - {"system-out"}
        expected = {"failed": {"failure"}, "error": {"error"}, "waived": {"skipped"}}.get(s["status"], set())
        assert children == expected, s["key"]
        if s["status"] == "waived":
            assert case.find("skipped").get("message") == s["reason"]
        if s["status"] == "failed":
            assert case.find("failure").get("message") == s["reason"]
        if s["status"] == "warned":
            assert f"warned: {s['reason']}" in case.find("system-out").text
        assert float(case.get("time")) == pytest.approx(s["duration_s"] or 0.0, abs=5e-4)


# --- targeted variants ------------------------------------------------------------------------------------

HOSTILE = '<script>alert("x")</script> & "quotes" \x1b[31mred\x1b[0m \x00 ]]>'


def _hostile(report: dict) -> dict:
    r = copy.deepcopy(report)
    s = next(s for s in r["scenarios"] if s["status"] == "failed")
    s["reason"] = HOSTILE
    s["description"] = '"><img src=x onerror=alert(1)>'
    s["evidence"].append({"kind": "<b>log</b>", "text": HOSTILE, "http_status": 500, "at_s": 0.1})
    r["target"]["notes"].append("<style>body{display:none}</style>")
    r["target"]["endpoint"] = "http://x/?a=1&b=<2>"
    r["verdict_reason"] = HOSTILE
    return r


def test_hostile_strings_render_inert_in_html():
    page = render_html(_hostile(_load("sample-failed-partial.json")))
    parsed = _parse(page)
    assert [t for t, _ in parsed.tags if t in ("script", "img")] == []
    assert [t for t, _ in parsed.tags if t == "style"] == ["style"]  # only the page's own
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &quot;quotes&quot;" in page
    assert "\x00" not in page and "\x1b" not in page
    visible = "".join(parsed.text)
    assert '<script>alert("x")</script> & "quotes"' in visible
    assert '"><img src=x onerror=alert(1)>' in visible


def test_hostile_strings_stay_well_formed_junit():
    report = _hostile(_load("sample-failed-partial.json"))
    root = _junit(report)  # parses: control characters and markup did not break the XML
    failure = next(c for c in root.iter("testcase") if c.find("failure") is not None
                   and c.find("failure").get("message").startswith("<script>"))
    assert failure.find("failure").get("message") == HOSTILE.replace("\x1b", "\ufffd").replace("\x00", "\ufffd")
    assert "<script>" in failure.find("failure").text  # the evidence, as text
    props = {p.get("name"): p.get("value") for p in root.find("testsuite").findall("properties/property")}
    assert props["target.endpoint"] == "http://x/?a=1&b=<2>"


def test_partial_report_is_marked():
    partial = _load("sample-failed-partial.json")
    assert partial["partial"]
    page = render_html(partial)
    assert 'data-partial="true"' in page
    assert "PARTIAL RUN: interrupted (Ctrl-C) during the fault phase" in page
    assert page.index('data-partial="true"') < page.index("<h2>")
    full = _load("sample-report.json")
    assert 'data-partial="true"' not in render_html(full)
    assert "PARTIAL RUN" not in render_html(full)


def test_absent_data_shows_not_measured_with_the_documents_reason():
    page = render_html(_load("sample-failed-partial.json"))
    expect = {
        "latency": "not run: the run was interrupted before the load phase",
        "decode-speed": "not run: the run was interrupted before the load phase",
        "stream-gaps": "no scenario recorded streaming event gaps",
        "probe-bandwidth": "accept --endpoint was given no probe report",
        "throttle": "accept --endpoint was given no probe report",
        "p2p-latency": "accept --endpoint was given no probe report",
    }
    for name, reason in expect.items():
        svg = _svg(page, name)
        assert 'class="plot not-measured"' in svg
        assert f"not measured: {reason}" in svg


def test_waived_fault_has_a_not_measured_timeline():
    report = _load("sample-report.json")
    waived = next(s for s in report["scenarios"] if s["group"] == "fault" and s["status"] == "waived")
    svg = _svg(render_html(report), f"recovery-{waived['key']}")
    assert f"not measured: {waived['reason']}" in svg


def test_unrecovered_repetition_is_shown():
    report = _load("sample-failed-partial.json")
    scenario = next(s for s in report["scenarios"]
                    if any(r["time_to_recover_s"] is None for r in s.get("repetitions", [])))
    svg = _svg(render_html(report), f"recovery-{scenario['key']}")
    assert svg.count("not recovered") == sum(r["time_to_recover_s"] is None for r in scenario["repetitions"])


def test_recovery_timeline_has_a_row_and_marks_per_repetition():
    report = _load("sample-report.json")
    scenario = next(s for s in report["scenarios"] if s["group"] == "fault" and s.get("repetitions"))
    svg = _svg(render_html(report), f"recovery-{scenario['key']}")
    for r in scenario["repetitions"]:
        assert f">rep {r['index']}<" in svg
        assert svg.count("recovered at ") == len(scenario["repetitions"])
        for e in r["events"]:
            assert e["label"] in svg


def test_figures_are_read_from_the_document_not_recomputed():
    report = _load("sample-report.json")
    # Figures that disagree with the raw data on purpose: a renderer that recomputed them would not show these.
    report["load"]["latency_s"]["p50"] = 0.777
    report["load"]["served_over_predicted"] = 0.5
    stream = next(s for s in report["scenarios"] if "stream_event_gaps_ms" in s.get("metrics", {}))
    stream["metrics"]["event_gap_ms_p50"] = 12.34
    stream["time_to_detect_s"] = {"median": 9.87, "worst": 10.5, "n": 4}
    page = render_html(report)
    assert "p50 0.777 s" in _svg(page, "latency")
    assert "served / predicted = 0.50" in _svg(page, "decode-speed")
    assert "p50 12.3 ms" in _svg(page, f"stream-gaps-{stream['key']}")
    assert "9.87 s / 10.5 s (n=4)" in page


def test_decode_speed_without_a_plan_says_so():
    report = _load("sample-report.json")
    report["plan"] = None
    report["load"].update(predicted_decode_tok_s=None, served_over_predicted=None)
    svg = _svg(render_html(report), "decode-speed")
    assert "no plan given" in svg
    assert 'class="plot not-measured"' not in svg  # the served speed is still drawn
    assert f">{fmt(report['load']['served_decode_tok_s'], 'tok/s')}<" in svg


def test_probe_plots_show_the_recording():
    report = _load("sample-report.json")
    probe = report["probe"]
    page = render_html(report)
    bw = _svg(page, "probe-bandwidth")
    for card in probe["cards"]:
        assert f"read {card['read_bw_gbps']:.0f} GB/s" in bw
        assert f"nominal {card['implied_bw_gbps']:.0f} GB/s" in bw
        th = _svg(page, f"throttle-card{card['index']}")
        points = re.search(r'<polyline points="([^"]*)"', th).group(1).split()
        assert len(points) == len([s for s in card["throttle"]["samples"] if s.get("sm_mhz") is not None])
        assert ">sw_power_cap<" in th  # the recording is power capped (reason bit 0x4)
    p2p = _svg(page, "p2p-latency")
    for pair in probe["pairs"]:
        assert f"{pair['p2p_direct_4k_us']:.1f} us" in p2p
        assert f"{pair['host_staged_4k_us']:.1f} us" in p2p


# --- writing ----------------------------------------------------------------------------------------------


def test_write_reports_writes_three_readable_files(tmp_path):
    report = _load("sample-report.json")
    out = tmp_path / "a" / "b"
    paths = write_reports(report, out)
    assert set(paths) == {"json", "html", "junit"}
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "report.html", "report.json"]
    assert json.loads(paths["json"].read_text()) == report
    assert paths["html"].read_text() == render_html(report)
    ET.parse(paths["junit"])
    for p in paths.values():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644


def test_write_reports_rejects_an_invalid_document_and_writes_nothing(tmp_path):
    report = _load("sample-report.json")
    del report["verdict"]
    with pytest.raises(DocumentError, match="verdict"):
        write_reports(report, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_write_reports_checks_the_embedded_probe(tmp_path):
    report = _load("sample-report.json")
    report["probe"]["cards"][0]["read_bw_gbps"] = "fast"
    with pytest.raises(DocumentError) as e:
        write_reports(report, tmp_path / "out")
    assert e.value.json_path == "$.probe.cards[0].read_bw_gbps"


def test_write_reports_into_a_file_path_is_bad_input(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(BadInput, match="not a directory"):
        write_reports(_load("sample-report.json"), target)


SECRET = "pw-Zq8-planted-secret-4411"


def test_renderers_add_no_secret_the_document_does_not_hold(tmp_path, monkeypatch, _isolated_home):
    """Secrets around the process (environment, home, working directory) never reach the outputs."""
    report = _load("sample-report.json")
    assert SECRET not in json.dumps(report)
    for var in ("V100PLAN_SSH_PASSWORD", "SSH_PASSWORD", "OPENAI_API_KEY", "HF_TOKEN", "V100PLAN_API_KEY"):
        monkeypatch.setenv(var, SECRET)
    (_isolated_home / "credentials").write_text(f"password={SECRET}\n")
    os.chmod(_isolated_home / "credentials", 0o600)
    monkeypatch.chdir(tmp_path)
    Path("secret.txt").write_text(SECRET)
    paths = write_reports(report, tmp_path / "out")
    for p in paths.values():
        assert SECRET not in p.read_text(), p.name
    assert SECRET not in render_html(report) + render_junit(report)
    assert json.loads(paths["json"].read_text()) == report  # nothing added, nothing dropped


def test_stream_gaps_plot_only_numbers_and_an_empty_list_is_not_measured():
    report = _load("sample-report.json")
    stream = next(s for s in report["scenarios"] if "stream_event_gaps_ms" in s.get("metrics", {}))
    stream["metrics"]["stream_event_gaps_ms"] = [5.0, None, "x", True, 7.5, 6.0]
    svg = _svg(render_html(report), f"stream-gaps-{stream['key']}")
    assert len(re.findall(r"<title>event \d+: ", svg)) == 3
    stream["metrics"]["stream_event_gaps_ms"] = []
    stream["reason"] = None
    svg = _svg(render_html(report), f"stream-gaps-{stream['key']}")
    assert "not measured: no streamed events recorded" in svg


def test_probe_without_cards_gives_the_probes_reason():
    report = _load("sample-report.json")
    probe = report["probe"]
    why = "no NVIDIA driver reachable: NVML could not start"
    probe.update(cards=[], pairs=[], overall="nothing_measured")
    for c in probe["cases"]:
        c.update(status="waived", reason=why if c["key"] == "inventory" else "needs a card")
    validate_report(report)
    page = render_html(report)
    for name in ("probe-bandwidth", "throttle", "p2p-latency"):
        assert f"not measured: the probe found no cards ({why})" in _svg(page, name)
    assert '<span class="status s-nothing_measured">' in page


def _golden(name: str, text: str) -> None:
    """Compare with tests/fixtures/acceptance/golden/NAME (tests/golden_files.py)."""
    golden_files.check(GOLDEN / name, text)


def test_golden_junit():
    _golden("junit-failed-partial.xml", render_junit(_load("sample-failed-partial.json")))


def test_golden_page_text():
    """What a person reads on the page (every text node, plots' labels included), one per line."""
    parsed = _parse(render_html(_load("sample-failed-partial.json")))
    lines = [" ".join(t.split()) for t in parsed.text]
    _golden("report-failed-partial.txt", "\n".join(t for t in lines if t) + "\n")


def test_a_run_stopped_by_ctrl_c_is_an_error_in_junit_even_with_no_scenario():
    """CI must not count a Ctrl-C'd qualify green: failures=0 alone would read as a pass."""
    report = copy.deepcopy(_load("sample-failed-partial.json"))
    report["scenarios"], report["summary"] = [], {k: 0 for k in report["summary"]}
    report["partial"], report["partial_reason"] = True, "interrupted (Ctrl-C) during start"
    root = _junit(report)
    assert root.get("errors") == "1" and root.get("failures") == "0"
    case = root.find("testsuite[@name='v100plan.accept.run']/testcase/error")
    assert case is not None and case.get("message") == "interrupted (Ctrl-C) during start"


def test_each_testsuite_is_stamped_with_its_first_scenarios_start():
    report = copy.deepcopy(_load("sample-report.json"))
    for i, s in enumerate(report["scenarios"]):
        s["started_utc"] = f"2026-12-01T10:{i:02d}:00Z"
    first = {}
    for s in report["scenarios"]:
        first.setdefault(s["group"], s["started_utc"])
    stamps = {x.get("name").rsplit(".", 1)[1]: x.get("timestamp") for x in _junit(report).findall("testsuite")}
    assert {g: stamps[g] for g in first} == first
    assert len(set(first.values())) == len(first) > 1  # not one write time for every suite


def test_the_target_shows_the_engines_speculation_and_its_acceptance_rate():
    report = _load("sample-report.json")
    report["target"]["speculation"] = {"method": "mtp", "draft_tokens": 3, "mode": "graphs", "drafted_tokens": 300,
                                       "accepted_tokens": 186, "acceptance_rate": 0.62}
    validate_report(report)
    text = " ".join(_parse(render_html(report)).text)
    assert "mtp, 3 drafts per round (graphs), acceptance 0.620 (186 of 300 drafts)" in text
    report["target"]["speculation"] = {**report["target"]["speculation"], "method": "off"}
    assert "drafts per round" not in render_html(report)  # off: no row
