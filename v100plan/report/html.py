"""The acceptance report as one self-contained HTML page: inline CSS, inline SVG, no script, no network.

``render_html(report)`` is a pure function of the document: it formats what the
AcceptanceReport holds (verdict first, then target, phases, scenarios, plots,
provenance) and computes nothing that a reader would take for a result. Every
string from the document is escaped; a Content-Security-Policy forbids scripts
and every fetch, so even a string that slipped through could not run or call out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from v100plan.report import plots
from v100plan.report.svg import PALETTE, esc, fmt, not_measured

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;color:#24292f;margin:0;background:#f6f8fa}
main{max-width:1040px;margin:0 auto;padding:20px 24px 48px;background:#fff}
h1{font-size:15px;font-weight:600;color:#57606a;margin:0 0 8px}
h2{font-size:19px;margin:32px 0 10px;border-bottom:1px solid #d8dee4;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.verdict{border-radius:8px;padding:16px 20px;color:#fff;margin-bottom:14px}
.verdict .word{font-size:40px;font-weight:800;letter-spacing:.04em;text-transform:uppercase}
.verdict .why{font-size:16px;margin-top:4px}
.verdict-passed{background:#1a7f37}.verdict-failed{background:#cf222e}.verdict-incomplete{background:#9a6700}
.partial{display:inline-block;margin-top:10px;background:#fff;color:#9a6700;font-weight:700;border-radius:4px;
 padding:3px 10px}
.counts span{display:inline-block;margin-right:14px;font-weight:600}
table{border-collapse:collapse;font-size:13px;margin:6px 0 10px;width:100%}
th,td{border-bottom:1px solid #d8dee4;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.status{background:#57606a;font-weight:700;text-transform:uppercase;font-size:11px;padding:1px 6px;border-radius:3px;color:#fff;
 white-space:nowrap}
.s-passed{background:#1a7f37}.s-warned{background:#b26a00}.s-failed{background:#cf222e}.s-error{background:#8250df}
.s-waived,.s-skipped,.s-nothing_measured,.s-not_measured{background:#6e7781}.s-interrupted{background:#9a6700}
.muted{color:#57606a}.desc{color:#57606a;font-size:12px}
.plot{display:block;width:100%;height:auto;box-sizing:border-box;margin:6px 0 14px;border:1px solid #d8dee4;border-radius:6px}
details{margin:4px 0 8px;font-size:13px}summary{cursor:pointer;font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f8fa;padding:6px 8px;border-radius:4px;margin:4px 0;
 font-size:12px}
ul.notes li{margin:2px 0}
footer{margin-top:36px;font-size:12px;color:#57606a}
"""


class Raw(str):
    """Markup built here, inserted into a table cell without escaping again."""


def _cell(value: Any) -> str:
    return value if isinstance(value, Raw) else esc("n/a" if value is None else value)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[int] = (), css: str = "") -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = "".join(f'<td class="num">{_cell(v)}</td>' if i in numeric else f"<td>{_cell(v)}</td>"
                        for i, v in enumerate(row))
        body.append(f"<tr>{cells}</tr>")
    klass = f' class="{css}"' if css else ""
    thead = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    return f"<table{klass}>{thead}<tbody>{''.join(body)}</tbody></table>"


def _status(status: str) -> Raw:
    return Raw(f'<span class="status s-{esc(status)}">{esc(status)}</span>')


def _spread(spread: dict[str, Any] | None) -> str:
    """'median / worst (n)' as the document gives them."""
    if not spread:
        return "n/a"
    return f"{fmt(spread['median'], 's')} / {fmt(spread['worst'], 's')} (n={spread['n']})"


def _verdict(report: dict[str, Any]) -> str:
    verdict = report["verdict"]
    partial = ""
    if report["partial"]:
        why = report.get("partial_reason") or "the run stopped before every scenario ran"
        partial = f'<div class="partial" data-partial="true">PARTIAL RUN: {esc(why)}</div>'
    counts = report["summary"]
    count_html = "".join(f'<span style="color:{PALETTE[k]}">{esc(counts[k])} {k}</span>'
                         for k in ("passed", "warned", "failed", "error", "waived"))
    wall = report.get("wall_s")
    return (f'<section class="verdict verdict-{esc(verdict)}" data-verdict="{esc(verdict)}">'
            f'<div class="word">{esc(verdict)}</div><div class="why">{esc(report["verdict_reason"])}</div>'
            f"{partial}</section>"
            f'<div class="counts">{count_html}'
            + (f'<span class="muted">wall time {esc(fmt(wall, "s"))}</span>' if wall is not None else "")
            + "</div>")


def _target(report: dict[str, Any]) -> str:
    t = report["target"]
    rows = [("mode", t["mode"]), ("endpoint", t["endpoint"]), ("host", t.get("host")), ("model", t["model"]),
            ("server", t.get("server"))]
    if "fault_control" in t:
        rows.append(("fault control", "answered" if t["fault_control"] else "not available"))
    spec = t.get("speculation")
    if spec and spec.get("method") not in (None, "off"):
        rate = spec.get("acceptance_rate")
        rows.append(("speculation", f"{spec['method']}, {spec.get('draft_tokens')} drafts per round"
                     + (f" ({spec['mode']})" if spec.get("mode") else "") + ", acceptance "
                     + (f"{rate:.3f} ({spec.get('accepted_tokens')} of {spec.get('drafted_tokens')} drafts)"
                        if rate is not None else "n/a (nothing drafted yet)")))
    engine = t.get("engine")
    if engine:
        rows.append(("engine", ", ".join(f"{k} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                                         for k, v in engine.items() if v is not None)))
    out = "<h2>Target</h2>" + _table(["", ""], [(k, v if v is not None else "n/a") for k, v in rows])
    notes = t.get("notes") or []
    if notes:
        out += "<h3>Notes</h3><ul class=\"notes\">" + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>"
    return out


def _phases(report: dict[str, Any]) -> str:
    rows = [(p["name"], _status(p["status"]), fmt(p["wall_s"], "s"), p["detail"]) for p in report["phases"]]
    return "<h2>Phases</h2>" + _table(["phase", "status", "wall", "detail"], rows, numeric=(2,))


def _scenarios(report: dict[str, Any]) -> str:
    rows = []
    for s in report["scenarios"]:
        key = Raw(f'<b>{esc(s["key"])}</b><div class="desc">{esc(s["description"])}</div>')
        rows.append((key, s["group"], _status(s["status"]), s["reason"] or "", fmt(s["duration_s"], "s"),
                     _spread(s.get("time_to_detect_s")), _spread(s.get("time_to_recover_s"))))
    if not rows:
        return "<h2>Scenarios</h2><p class=\"muted\">No scenario ran.</p>"
    table = _table(["scenario", "group", "status", "reason", "duration", "detect: median / worst",
                    "recover: median / worst"], rows, numeric=(4, 5, 6), css="scenarios")
    return "<h2>Scenarios</h2>" + table + _details(report["scenarios"])


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f" ... ({len(text)} characters)"


def _details(scenarios: list[dict[str, Any]]) -> str:
    """Metrics, repetitions and evidence per scenario, folded away under the table."""
    out = []
    for s in scenarios:
        inner = []
        metrics = s.get("metrics") or {}
        if metrics:
            rows = [(k, f"list of {len(v)} values (plotted below)" if k == "stream_event_gaps_ms"
                     else _short(json.dumps(v))) for k, v in metrics.items()]
            inner.append(_table(["metric", "value"], rows))
        for r in s.get("repetitions") or []:
            events = "; ".join(f"{fmt(e['t_s'], 's')} {e['label']}" for e in r["events"])
            inner.append(f"<div>rep {esc(r['index'])} {_status(r['status'])} detect {esc(fmt(r['time_to_detect_s'], 's'))}"
                         f", recover {esc(fmt(r['time_to_recover_s'], 's'))}: {esc(r['detail'])}"
                         f'<div class="desc">{esc(events)}</div></div>')
        for e in s["evidence"]:
            where = []
            if e.get("http_status") is not None:
                where.append(f"HTTP {e['http_status']}")
            if e.get("at_s") is not None:
                where.append(f"at {fmt(e['at_s'], 's')}")
            inner.append(f"<div><b>{esc(e['kind'])}</b> <span class=\"muted\">{esc(', '.join(where))}</span>"
                         f"<pre>{esc(e['text'])}</pre></div>")
        if inner:
            what = [f"{len(metrics)} metric(s)"] if metrics else []
            what += [f"{len(s.get('repetitions') or [])} repetition(s)"] if s.get("repetitions") else []
            what += [f"{len(s['evidence'])} evidence item(s)"] if s["evidence"] else []
            out.append(f'<details data-scenario="{esc(s["key"])}"><summary>{esc(s["key"])}: '
                       f"{esc(', '.join(what))}</summary>{''.join(inner)}</details>")
    return "".join(out)


def _absent(report: dict[str, Any], field: str, default: str) -> str:
    return (report.get("unavailable") or {}).get(field) or default


def _load_why_absent(report: dict[str, Any]) -> str:
    for s in report["scenarios"]:
        if s["group"] == "load" and s.get("reason"):
            return s["reason"]
    return _absent(report, "load", "the load scenario did not run")


def _load(report: dict[str, Any]) -> str:
    load = report["load"]
    why = _load_why_absent(report)
    out = ["<h2>Load</h2>"]
    if load is not None:
        lat = load.get("latency_s") or {}
        ttft = load.get("ttft_s") or {}
        rows = [("clients", load["clients"]), ("requests", load["requests"]),
                ("mix", ", ".join(f"{k} {v}" for k, v in load["mix"].items())),
                ("outcomes", ", ".join(f"{k} {v}" for k, v in load["outcomes"].items())),
                ("latency p50 / p90 / p99 / max", " / ".join(fmt(lat.get(k), "s") for k in ("p50", "p90", "p99", "max"))),
                ("time to first token p50 / p99", " / ".join(fmt(ttft.get(k), "s") for k in ("p50", "p99"))
                 if ttft else "n/a"),
                ("tokens/s (all correct requests)", fmt(load["tokens_per_s"], "tok/s")),
                ("wall", fmt(load["wall_s"], "s"))]
        rows += [(f"{k}: unavailable", v) for k, v in (load.get("unavailable") or {}).items()]
        out.append(_table(["", ""], rows))
    out.append(plots.latency_histogram(load, why))
    out.append(plots.decode_speed(load, report["plan"] is not None, why))
    return "".join(out)


def _faults(report: dict[str, Any]) -> str:
    faults = [s for s in report["scenarios"] if s["group"] == "fault"]
    if not faults:
        return ""
    return "<h2>Fault recovery</h2>" + "".join(plots.recovery_timeline(s) for s in faults)


def _streams(report: dict[str, Any]) -> str:
    streams = [s for s in report["scenarios"] if isinstance((s.get("metrics") or {}).get("stream_event_gaps_ms"), list)]
    out = ["<h2>Streaming</h2>"]
    if not streams:
        out.append(not_measured("stream-gaps", "no scenario recorded streaming event gaps",
                                      "Gaps between streamed events"))
    out += [plots.stream_gaps(s) for s in streams]
    return "".join(out)


def _hardware(report: dict[str, Any]) -> str:
    probe = report["probe"]
    out = ["<h2>Hardware (probe report)</h2>"]
    if probe is None:
        why = _absent(report, "probe", "no probe report was given to this run")
        out.append(not_measured("probe-bandwidth", why, "Memory bandwidth per card against nominal"))
        out.append(not_measured("throttle", why, "Clocks, temperature and clock-event reasons under load"))
        out.append(not_measured("p2p-latency", why, "Peer-to-peer 4 KB latency, direct vs host-staged"))
        return "".join(out)
    host = probe["host"]
    prov = probe["provenance"]
    out.append(f'<p class="muted">probe of {esc(prov["created_utc"])}, overall {_status(probe["overall"])}; driver '
               f'{esc(host["driver_version"] or "n/a")}, CUDA {esc(host["cuda_driver_version"] or "n/a")}, NCCL '
               f'{esc(host["nccl_version"] or "n/a")}</p>')
    out.append(plots.probe_bandwidth(probe))
    if probe["cards"]:
        for card in probe["cards"]:
            explanation = card["throttle"].get("explanation")
            out.append(f"<h3>card {esc(card['index'])}: throttle {esc(card['throttle']['verdict'])}</h3>")
            if explanation:
                out.append(f'<p class="desc">{esc(explanation)}</p>')
            out.append(plots.throttle_timeline(card))
    else:
        out.append(not_measured("throttle", plots.no_cards_reason(probe),
                                      "Clocks, temperature and clock-event reasons under load"))
    out.append(plots.p2p_matrix(probe))
    return "".join(out)


def _plan(report: dict[str, Any]) -> str:
    plan = report["plan"]
    if plan is None:
        return "<h2>Plan</h2><p class=\"muted\">" + esc(_absent(report, "plan", "no plan given")) + "</p>"
    i = plan["inputs"]
    out = [f"<h2>Plan</h2><p>{esc(i['model'])} on {esc(i['gpus'])} x {esc(i['card'])}, engine {esc(i['engine'])}, "
           f"context {esc(i['context_tokens'])} tokens; recommended: <b>{esc(plan['recommended'] or 'none')}</b></p>"]
    rows = [(s["name"] + (" (recommended)" if s["name"] == plan["recommended"] else ""), "yes" if s["fits"] else "no",
             fmt(s["decode_tok_s"], "tok/s"), fmt(s["decode_ceiling_tok_s"], "tok/s"), s["allreduce_path"])
            for s in plan["strategies"]]
    out.append(_table(["strategy", "fits", "decode", "ceiling", "allreduce"], rows, numeric=(2, 3)))
    return "".join(out)


_FIGURE_NAMES = {"decode_tok_s": "decode at the served context", "ttft_s": "TTFT of a long prompt",
                 "memory_per_gpu_gb": "memory per GPU", "max_context": "max context"}


def _plan_vs_measured(report: dict[str, Any]) -> str:
    """Each planned figure beside the measured one: the error, and whether the measurement fell in the interval."""
    pvm = report.get("plan_vs_measured")
    head = "<h2>Plan against measurement</h2>"
    if not pvm or not pvm.get("figures"):
        why = (pvm or {}).get("why") or "this report predates the comparison"
        return head + f"<p class=\"muted\">No figures: {esc(why)}</p>"

    def interval(f: dict[str, Any]) -> str:
        return f"{fmt(f['interval'][0])} - {fmt(f['interval'][1])}" if f["interval"] else "none"

    rows = [(_FIGURE_NAMES.get(f["figure"], f["figure"]), f["unit"], fmt(f["predicted"]), interval(f),
             fmt(f["measured"]) if f["measured"] is not None else "not measured",
             f"{f['error'] * 100:+.1f} %" if f["error"] is not None else "n/a",
             {True: "yes", False: "no", None: "n/a"}[f["inside_interval"]], f["why"] or "")
            for f in pvm["figures"]]
    out = [head, f"<p>The plan's {esc(pvm['strategy'])} row at {esc(pvm['context_tokens'])} tokens of context; "
                 f"measured at {esc(pvm['measured_context_tokens'] or 'n/a')}.</p>",
           _table(["figure", "unit", "predicted", "interval", "measured", "error", "inside", "note"], rows,
                  numeric=(2, 4, 5))]
    out += [f"<p class=\"muted\">{esc(n)}</p>" for n in pvm.get("notes") or []]
    return "".join(out)


def _provenance(report: dict[str, Any]) -> str:
    p = report["provenance"]
    rows = [(k, p[k] if not isinstance(p[k], (dict, list)) else Raw(f"<pre>{esc(json.dumps(p[k], indent=1))}</pre>"))
            for k in p]
    unavailable = report.get("unavailable") or {}
    out = "<h2>Provenance</h2>" + _table(["", ""], rows)
    if unavailable:
        out += "<h3>Not available</h3>" + _table(["field", "why"], unavailable.items())
    return out


def render_html(report: dict[str, Any]) -> str:
    """The whole page for one AcceptanceReport (already validated by the caller)."""
    t = report["target"]
    title = f"v100plan acceptance: {report['verdict']} - {t['model']} at {t['endpoint']}"
    body = "".join([
        f"<h1>{esc(title)}</h1>",
        _verdict(report),
        _target(report),
        _phases(report),
        _scenarios(report),
        _faults(report),
        _load(report),
        _streams(report),
        _hardware(report),
        _plan(report),
        _plan_vs_measured(report),
        _provenance(report),
        f"<footer>Written by {esc(report['provenance']['tool'])} {esc(report['provenance']['tool_version'])} from "
        f"an acceptance_report document, schema {esc(report['schema_version'])}.</footer>",
    ])
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)}</title><style>{STYLE}</style></head>"
            f"<body><main>{body}</main></body></html>\n")
