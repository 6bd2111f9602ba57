"""The acceptance report's plots, each drawn from one part of an AcceptanceReport.

Each function returns one <svg data-plot="NAME"> (see svg.frame) or, when its data
is absent, the "not measured: REASON" box under the same name. They format what
the document holds (binning a histogram, placing marks); figures such as medians,
percentiles and ratios are read from the document, never recomputed.
"""

from __future__ import annotations

from typing import Any

from probes.clock_reasons import decode as decode_reasons
from v100plan.report.svg import (
    PALETTE,
    PLOT_WIDTH,
    Scale,
    circle,
    esc,
    fmt,
    frame,
    legend,
    line,
    nice_max,
    nice_ticks,
    not_measured,
    polyline,
    rect,
    text,
    x_axis,
    y_axis,
)

WIDTH = PLOT_WIDTH


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _label_at(x: float, y: float, label: str, right: float, color: str, size: int = 10, gap: float = 4) -> str:
    """A bold label beside a mark at x: to its right, or to its left when it would leave the plot."""
    if x + gap + len(label) * size * 0.6 > right + 20:
        return text(x - gap, y, label, anchor="end", size=size, fill=color, weight="600")
    return text(x + gap, y, label, size=size, fill=color, weight="600")


def _why(unavailable: dict[str, str] | None, field: str, default: str) -> str:
    return (unavailable or {}).get(field) or default


# --- acceptance -----------------------------------------------------------------------------------------


def recovery_timeline(scenario: dict[str, Any]) -> str:
    """Per repetition a row from injection (t=0) to detection and recovery, events as marks."""
    name = f"recovery-{scenario['key']}"
    title = f"{scenario['key']}: injection to detection and recovery"
    reps = scenario.get("repetitions") or []
    if not reps:
        reason = scenario.get("reason") or f"no repetitions recorded (status {scenario['status']})"
        return not_measured(name, reason, title)
    times = [0.0]
    for r in reps:
        times += [t for t in (r["time_to_detect_s"], r["time_to_recover_s"]) if t is not None]
        times += [e["t_s"] for e in r["events"]]
    t_lo, t_hi = min(times), nice_max(max(times))
    left, right, top, row_h = 120, WIDTH - 24, 34, 30
    height = top + row_h * len(reps) + 52
    xs = Scale(t_lo, t_hi, left, right)
    parts = [legend(left, 16, [(PALETTE["failed"], "injection"), (PALETTE["detect"], "detected"),
                               (PALETTE["recover"], "recovered"), (PALETTE["ink"], "event")], step=110)]
    for i, r in enumerate(reps):
        y = top + row_h * i + row_h / 2
        status = r["status"]
        parts.append(text(8, y + 4, f"rep {r['index']}", size=11))
        parts.append(text(60, y + 4, status, size=10, fill=PALETTE.get(status, PALETTE["ink"]), weight="600"))
        parts.append(line(xs.a, y, xs.b, y, PALETTE["grid"]))
        detect, recover = r["time_to_detect_s"], r["time_to_recover_s"]
        if detect is not None:
            parts.append(rect(xs(0), y - 5, xs(detect) - xs(0), 10, PALETTE["detect"], opacity=0.35,
                              tip=f"injection to detection: {fmt(detect, 's')}"))
        if recover is not None:
            start = detect if detect is not None else 0.0
            parts.append(rect(xs(start), y - 5, xs(recover) - xs(start), 10, PALETTE["recover"], opacity=0.25,
                              tip=f"to recovery: {fmt(recover, 's')}"))
        for e in r["events"]:
            x = xs(e["t_s"])
            parts.append(line(x, y - 9, x, y + 9, PALETTE["ink"], 1.2, tip=f"{fmt(e['t_s'], 's')}: {e['label']}"))
        if detect is not None:
            parts.append(circle(xs(detect), y, 5, PALETTE["detect"], tip=f"detected at {fmt(detect, 's')}"))
        if recover is not None:
            parts.append(circle(xs(recover), y, 5, PALETTE["recover"], tip=f"recovered at {fmt(recover, 's')}"))
            parts.append(_label_at(xs(recover), y - 6, fmt(recover, "s"), right, PALETTE["recover"], gap=8))
        else:
            start = xs(detect if detect is not None else 0.0)
            parts.append(line(start, y, xs.b, y, PALETTE["failed"], 2, dash="4 3", tip="no recovery observed"))
            parts.append(text(xs.b, y - 8, "not recovered", anchor="end", size=10, fill=PALETTE["failed"],
                              weight="600"))
    bottom = top + row_h * len(reps)
    parts.append(line(xs(0), top - 4, xs(0), bottom, PALETTE["failed"], 2, tip="injection (t = 0)"))
    parts.append(x_axis(xs, bottom + 4, nice_ticks(t_lo, t_hi), "time after injection", "s"))
    return frame(name, WIDTH, height, "".join(parts), title)


def latency_histogram(load: dict[str, Any] | None, why_absent: str) -> str:
    """Histogram of every completed request's end-to-end latency, p50 and p99 from the document."""
    name, title = "latency", "End-to-end latency under load"
    if load is None:
        return not_measured(name, why_absent, title)
    values = load["latencies_s"]
    if not values:
        return not_measured(name, _why(load.get("unavailable"), "latencies_s", "no request completed"), title)
    hi = nice_max(max(values))
    bins = 24
    counts = [0] * bins
    for v in values:
        counts[min(int(v / hi * bins), bins - 1)] += 1
    left, right, top, bottom = 60, WIDTH - 24, 36, 200
    xs, ys = Scale(0, hi, left, right), Scale(0, nice_max(max(counts) * 1.25), bottom, top)  # headroom for the p50 / p99 labels
    parts = [y_axis(ys, left, nice_ticks(0, ys.hi, 4), "requests", grid_to=right)]
    width = (right - left) / bins
    for i, c in enumerate(counts):
        if c:
            lo_s, hi_s = hi * i / bins, hi * (i + 1) / bins
            parts.append(rect(left + i * width + 1, ys(c), width - 2, bottom - ys(c), PALETTE["accent"],
                              tip=f"{c} request(s) between {fmt(lo_s, 's')} and {fmt(hi_s, 's')}"))
    marks = load.get("latency_s") or {}
    for key, color, dy in (("p50", PALETTE["recover"], 0), ("p99", PALETTE["failed"], 14)):
        v = marks.get(key)
        if v is not None:
            x = xs(min(v, hi))
            parts.append(line(x, top - 6, x, bottom, color, 2, dash="5 3", tip=f"{key} {fmt(v, 's')}"))
            parts.append(_label_at(x, top + 4 + dy, f"{key} {fmt(v, 's')}", right, color, size=11))
    parts.append(x_axis(xs, bottom, nice_ticks(0, hi), f"latency, {len(values)} requests", "s"))
    return frame(name, WIDTH, bottom + 40, "".join(parts), title)


def decode_speed(load: dict[str, Any] | None, plan_given: bool, why_absent: str) -> str:
    """Served one-stream decode speed beside the plan's prediction and their ratio."""
    name, title = "decode-speed", "Served vs predicted decode speed (one stream)"
    if load is None:
        return not_measured(name, why_absent, title)
    served, predicted = load["served_decode_tok_s"], load["predicted_decode_tok_s"]
    unavailable = load.get("unavailable")
    if served is None:
        return not_measured(name, _why(unavailable, "served_decode_tok_s", "no streamed request completed"), title)
    left, right, top = 170, WIDTH - 110, 26
    xs = Scale(0, nice_max(max(served, predicted or 0)), left, right)
    ratio = load["served_over_predicted"]
    parts = [text(left, 12, "served / predicted = " + (f"{ratio:.2f}" if ratio is not None else "n/a"), size=12,
                  weight="600", css="ratio")]
    rows = [("served (median stream)", served, PALETTE["accent"]), ("predicted (plan)", predicted, PALETTE["waived"])]
    for i, (label, value, color) in enumerate(rows):
        y = top + i * 34
        parts.append(text(left - 8, y + 15, label, anchor="end", size=11))
        if value is None:
            why = "no plan given" if not plan_given else "not predicted: " + _why(
                unavailable, "predicted_decode_tok_s", "the plan has no speed for this strategy")
            parts.append(rect(left, y + 2, right - left, 20, "#f6f8fa", stroke=PALETTE["waived"], dash="4 3"))
            parts.append(text(left + 8, y + 16, why, size=11, fill=PALETTE["waived"], css="no-plan"))
        else:
            parts.append(rect(left, y + 2, xs(value) - left, 20, color, tip=f"{label}: {fmt(value, 'tok/s')}"))
            parts.append(text(xs(value) + 6, y + 16, fmt(value, "tok/s"), size=11, weight="600"))
    bottom = top + 2 * 34
    parts.append(x_axis(xs, bottom, nice_ticks(0, xs.hi), "decode speed", "tok/s"))
    return frame(name, WIDTH, bottom + 40, "".join(parts), title)


def stream_gaps(scenario: dict[str, Any]) -> str:
    """The time between consecutive streamed events, in arrival order (stalls stand out)."""
    name = f"stream-gaps-{scenario['key']}"
    title = f"{scenario['key']}: gaps between streamed events"
    metrics = scenario.get("metrics") or {}
    gaps = [g for g in metrics.get("stream_event_gaps_ms") or [] if _is_number(g)]
    if not gaps:
        return not_measured(name, scenario.get("reason") or "no streamed events recorded", title)
    left, right, top, bottom = 60, WIDTH - 100, 30, 180
    xs, ys = Scale(0, len(gaps), left, right), Scale(0, nice_max(max(gaps)), bottom, top)
    used: list[float] = []
    parts = [y_axis(ys, left, nice_ticks(0, ys.hi, 4), "gap (ms)", grid_to=right)]
    w = (right - left) / len(gaps)
    for i, g in enumerate(gaps):
        parts.append(rect(xs(i) + w * 0.1, ys(g), max(w * 0.8, 0.8), bottom - ys(g), PALETTE["accent"],
                          tip=f"event {i + 1}: {fmt(g, 'ms')}"))
    for key, color in (("event_gap_ms_p50", PALETTE["recover"]), ("event_gap_ms_p99", PALETTE["failed"]),
                       ("event_gap_ms_max", PALETTE["warned"])):
        v = metrics.get(key)
        if _is_number(v):
            y = ys(min(v, ys.hi))
            parts.append(line(left, y, right, y, color, 1.5, dash="5 3", tip=f"{key} = {fmt(v, 'ms')}"))
            label_y = y + 3
            while any(abs(label_y - u) < 11 for u in used):
                label_y += 11
            used.append(label_y)
            parts.append(text(right + 6, label_y, f"{key.replace('event_gap_ms_', '')} {fmt(v, 'ms')}",
                              size=10, fill=color, weight="600"))
    parts.append(x_axis(xs, bottom, nice_ticks(0, len(gaps)), "streamed event number"))
    return frame(name, WIDTH, bottom + 40, "".join(parts), title)


# --- probe ----------------------------------------------------------------------------------------------


def no_cards_reason(probe: dict[str, Any]) -> str:
    """Why a probe report has no cards, in the probe's own words (its inventory case) where it gives them."""
    cases = sorted(probe["cases"], key=lambda c: c["key"] != "inventory")
    reason = next((c["reason"] for c in cases if c["status"] in ("waived", "failed", "error") and c["reason"]), None)
    return f"the probe found no cards ({reason})" if reason else "the probe found no cards"


def probe_bandwidth(probe: dict[str, Any]) -> str:
    """Per card: measured read and copy bandwidth against the nominal (clock x bus width) figure."""
    name, title = "probe-bandwidth", "Memory bandwidth per card against nominal"
    cards = probe["cards"]
    if not cards:
        return not_measured(name, no_cards_reason(probe), title)
    values = [v for c in cards for v in (c["read_bw_gbps"], c["copy_bw_gbps"], c["implied_bw_gbps"]) if v is not None]
    if not values:
        return not_measured(name, _why(cards[0]["unavailable"], "read_bw_gbps", "bandwidth was not probed"), title)
    left, right, top, group_h = 150, WIDTH - 90, 34, 52
    xs = Scale(0, nice_max(max(values)), left, right)
    bottom = top + group_h * len(cards)
    parts = [legend(left, 16, [(PALETTE["accent"], "read"), (PALETTE["accent2"], "copy"),
                               (PALETTE["ink"], "nominal (implied)")], step=90)]
    for t in nice_ticks(0, xs.hi):
        parts.append(line(xs(t), top - 4, xs(t), bottom, PALETTE["grid"]))
    for i, c in enumerate(cards):
        y = top + group_h * i
        parts.append(text(left - 8, y + 16, f"card {c['index']}", anchor="end", size=11, weight="600"))
        parts.append(text(left - 8, y + 30, c["name"], anchor="end", size=10, fill=PALETTE["axis"]))
        for j, (field, color) in enumerate((("read_bw_gbps", PALETTE["accent"]), ("copy_bw_gbps", PALETTE["accent2"]))):
            v, by = c[field], y + 6 + j * 18
            if v is None:
                parts.append(text(left + 4, by + 12, "not measured: " + _why(c["unavailable"], field, "not probed"),
                                  size=10, fill=PALETTE["waived"]))
                continue
            parts.append(rect(left, by, xs(v) - left, 15, color, tip=f"{field} {fmt(v, 'GB/s', 4)}"))
            parts.append(text(xs(v) - 4, by + 12, f"{field[:4]} {fmt(v, 'GB/s', 4)}", anchor="end", size=10,
                              fill="#ffffff", weight="600"))
        nominal = c["implied_bw_gbps"]
        if nominal is not None:
            x = xs(nominal)
            parts.append(line(x, y + 2, x, y + 44, PALETTE["ink"], 2.5,
                              tip=f"nominal {fmt(nominal, 'GB/s', 4)} (memory clock x bus width)"))
            parts.append(text(x + 4, y + 44, f"nominal {fmt(nominal, 'GB/s', 4)}", size=10, fill=PALETTE["ink"]))
    parts.append(x_axis(xs, bottom, nice_ticks(0, xs.hi), "bandwidth", "GB/s"))
    return frame(name, WIDTH, bottom + 40, "".join(parts), title)


_REASON_COLORS = ["#cf222e", "#d4a72c", "#8250df", "#0969da", "#bf3989", "#1a7f37", "#57606a", "#953800", "#116329"]


def throttle_timeline(card: dict[str, Any]) -> str:
    """SM clock and temperature over the sustained load, with the active clock-event reasons underneath."""
    name = f"throttle-card{card['index']}"
    title = f"card {card['index']} ({card['name']}): clocks, temperature and clock-event reasons under load"
    th = card["throttle"]
    samples = th.get("samples") or []
    if not samples:
        reason = _why(th.get("unavailable"), "samples",
                      th.get("explanation") or ("throttle " + th["verdict"].replace("_", " ")
                                                if th["verdict"] == "not_measured" else "no samples kept"))
        return not_measured(name, reason, title)
    t_end = max(s["t_s"] for s in samples) or 1.0
    active: list[str] = []
    for s in samples:
        for r in decode_reasons(s.get("reasons")):
            if r not in active:
                active.append(r)
    left, right, top, plot_bottom = 150, WIDTH - 50, 34, 190
    strip_h = 14
    height = plot_bottom + 34 + strip_h * len(active) + (14 if not active else 0) + 40
    xs = Scale(0, t_end, left, right)
    clocks = [s["sm_mhz"] for s in samples if s.get("sm_mhz") is not None]
    temps = [s["temp_c"] for s in samples if s.get("temp_c") is not None]
    clock_hi = nice_max(max(clocks + [card.get("sm_clock_max_mhz") or 0] or [1]))
    ys_clock = Scale(0, clock_hi, plot_bottom, top)
    temp_hi = nice_max(max(temps + [th.get("temp_slowdown_c") or 0] or [1]))
    ys_temp = Scale(0, temp_hi, plot_bottom, top)
    parts = [legend(left, 16, [(PALETTE["accent"], "SM clock (MHz)"), (PALETTE["failed"], "temperature (C)")],
                    step=140)]
    parts.append(y_axis(ys_clock, left, nice_ticks(0, clock_hi, 4), "MHz", grid_to=right, color=PALETTE["accent"]))
    if temps:
        parts.append(y_axis(ys_temp, right, nice_ticks(0, temp_hi, 4), "C", right=True, color=PALETTE["failed"]))
    if card.get("sm_clock_max_mhz"):
        y = ys_clock(card["sm_clock_max_mhz"])
        parts.append(line(left, y, right, y, PALETTE["accent"], 1, dash="2 3", tip="max SM clock"))
        parts.append(text(left + 4, y - 3, f"max {card['sm_clock_max_mhz']} MHz", size=10, fill=PALETTE["accent"]))
    if th.get("temp_slowdown_c") and temps:
        y = ys_temp(th["temp_slowdown_c"])
        parts.append(line(left, y, right, y, PALETTE["failed"], 1, dash="2 3", tip="slowdown temperature"))
        parts.append(text(right - 4, y - 3, f"slowdown {th['temp_slowdown_c']} C", anchor="end", size=10,
                          fill=PALETTE["failed"]))
    parts.append(polyline([(xs(s["t_s"]), ys_clock(s["sm_mhz"])) for s in samples if s.get("sm_mhz") is not None],
                          PALETTE["accent"], 1.8))
    if temps:
        parts.append(polyline([(xs(s["t_s"]), ys_temp(s["temp_c"])) for s in samples if s.get("temp_c") is not None],
                              PALETTE["failed"], 1.5))
    parts.append(x_axis(xs, plot_bottom, nice_ticks(0, t_end), "time", "s"))
    strip_top = plot_bottom + 40
    step = (right - left) / max(len(samples), 1)
    if not active:
        parts.append(text(left, strip_top + 10, "no clock-event reason active in any sample", size=10,
                          fill=PALETTE["waived"]))
    for k, reason in enumerate(active):
        y = strip_top + k * strip_h
        color = _REASON_COLORS[k % len(_REASON_COLORS)]
        parts.append(text(left - 6, y + 10, reason, anchor="end", size=9, fill=color))
        parts.append(rect(left, y + 1, right - left, strip_h - 3, "#f6f8fa"))
        run_start = None
        for i, s in enumerate(samples + [None]):
            on = s is not None and reason in decode_reasons(s.get("reasons"))
            if on and run_start is None:
                run_start = i
            elif not on and run_start is not None:
                t0, t1 = samples[run_start]["t_s"], samples[i - 1]["t_s"]
                parts.append(rect(xs(t0), y + 1, max(xs(t1) - xs(t0), step), strip_h - 3, color,
                                  tip=f"{reason} active {fmt(t0, 's')} to {fmt(t1, 's')}"))
                run_start = None
    return frame(name, WIDTH, height, "".join(parts), title)


def p2p_matrix(probe: dict[str, Any]) -> str:
    """Source x destination grid: 4 KB direct vs host-staged latency (and bulk bandwidth) per pair."""
    name, title = "p2p-latency", "Peer-to-peer 4 KB latency, direct vs host-staged"
    pairs = probe["pairs"]
    if not pairs:
        n = len(probe["cards"])
        why = {0: no_cards_reason(probe), 1: "one card: no pairs to measure"}.get(n, "no card pairs were probed")
        return not_measured(name, why, title)
    idx = sorted({p["src"] for p in pairs} | {p["dst"] for p in pairs})
    by = {(p["src"], p["dst"]): p for p in pairs}
    lat = [v for p in pairs for v in (p["p2p_direct_4k_us"], p["host_staged_4k_us"]) if v is not None]
    lat_hi = nice_max(max(lat)) if lat else 1.0
    left, top, cell_w, cell_h = 90, 52, 250, 84
    width = max(WIDTH, left + cell_w * len(idx) + 20)
    height = top + cell_h * len(idx) + 16
    parts = [text(left + cell_w * len(idx) / 2, 16, "destination card", anchor="middle", size=11, fill=PALETTE["axis"]),
             text(8, 16, "source card", size=11, fill=PALETTE["axis"]),
             legend(left, 34, [(PALETTE["accent"], "direct"), (PALETTE["waived"], "host-staged")], step=90)]
    for j, d in enumerate(idx):
        parts.append(text(left + cell_w * j + cell_w / 2, top - 4, f"{d}", anchor="middle", size=11, weight="600"))
    for i, s in enumerate(idx):
        y0 = top + cell_h * i
        parts.append(text(left - 12, y0 + cell_h / 2 + 4, f"{s}", anchor="end", size=11, weight="600"))
        for j, d in enumerate(idx):
            x0 = left + cell_w * j
            p = by.get((s, d))
            if s == d or p is None:
                parts.append(rect(x0, y0, cell_w - 4, cell_h - 4, "#f6f8fa", stroke=PALETTE["grid"]))
                parts.append(text(x0 + cell_w / 2, y0 + cell_h / 2, "—" if s == d else "not probed",
                                  anchor="middle", size=11, fill=PALETTE["waived"]))
                continue
            tint = {"working": "#dafbe1", "broken": "#ffebe9"}.get(p["verdict"], "#f6f8fa")
            parts.append(rect(x0, y0, cell_w - 4, cell_h - 4, tint, stroke=PALETTE["grid"],
                              tip=p.get("explanation") or p["verdict"]))
            parts.append(text(x0 + 8, y0 + 16, f"{p['verdict']}; NVLink links: "
                              + ("n/a" if p["nvlink_links"] is None else str(p["nvlink_links"])), size=10))
            xs = Scale(0, lat_hi, x0 + 60, x0 + cell_w - 70)
            for k, (field, label, color) in enumerate((("p2p_direct_4k_us", "direct", PALETTE["accent"]),
                                                       ("host_staged_4k_us", "staged", PALETTE["waived"]))):
                v, by_ = p[field], y0 + 26 + k * 18
                parts.append(text(x0 + 8, by_ + 11, label, size=10))
                if v is None:
                    parts.append(text(x0 + 60, by_ + 11, "n/a: " + _why(p["unavailable"], field, "not measured"),
                                      size=9, fill=PALETTE["waived"]))
                    continue
                parts.append(rect(xs.a, by_, xs(v) - xs.a, 13, color, tip=f"{label} 4 KB {fmt(v, 'us')}"))
                parts.append(text(xs(v) + 4, by_ + 11, fmt(v, "us"), size=10, weight="600"))
            bulk = p["p2p_bulk_gbps"]
            parts.append(text(x0 + 8, y0 + cell_h - 12, "bulk " + (fmt(bulk, "GB/s", 4) if bulk is not None else
                                                                  "n/a: " + _why(p["unavailable"], "p2p_bulk_gbps",
                                                                                 "not measured")), size=10))
    return frame(name, width, height, "".join(parts), title)


def plot_names(report: dict[str, Any]) -> list[str]:
    """Every data-plot name the HTML page carries for this report (tests look each one up)."""
    names = [f"recovery-{s['key']}" for s in report["scenarios"] if s["group"] == "fault"]
    names += ["latency", "decode-speed"]
    streams = [s for s in report["scenarios"] if isinstance((s.get("metrics") or {}).get("stream_event_gaps_ms"), list)]
    names += [f"stream-gaps-{s['key']}" for s in streams] or ["stream-gaps"]
    names += ["probe-bandwidth"]
    probe = report["probe"]
    names += [f"throttle-card{c['index']}" for c in probe["cards"]] if probe and probe["cards"] else ["throttle"]
    names += ["p2p-latency"]
    return names


__all__ = ["decode_speed", "esc", "latency_histogram", "p2p_matrix", "plot_names", "probe_bandwidth",
           "recovery_timeline", "stream_gaps", "throttle_timeline"]
