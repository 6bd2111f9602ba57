"""The written report.html opened in real headless Chromium: no console errors, no network,
every plot laid out with a non-zero size and drawn content, and a full-page screenshot.

Chromium is driven over the Chrome DevTools Protocol on a pipe (--remote-debugging-pipe:
NUL-separated JSON on file descriptors 3 and 4), so no port is opened and no client
package is needed. One browser serves every page of the module.

V100PLAN_REFRESH_SCREENSHOT=1 also copies the screenshot of a real CPU `v100plan qualify` run's report
(SCREENSHOT_REPORT) to docs/acceptance-report.png, the README's picture (otherwise the tree is left alone).
"""

from __future__ import annotations

import base64
import copy
import fcntl
import json
import os
import queue
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, REPO
from v100plan.report import write_reports
from v100plan.report.plots import plot_names

CHROMIUM = os.environ.get("V100PLAN_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars", "--mute-audio",
         "--remote-debugging-pipe"]
WIDTH = 1100
TIMEOUT_S = 30.0
REPORTS = sorted((FIXTURES / "acceptance").glob("*.json"))
SCREENSHOT = REPO / "docs" / "acceptance-report.png"
SCREENSHOT_REPORT = "qualify-cpu-2026-12-01.json"  # `v100plan qualify` on this project's 2-core CPU machine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"needs headless Chromium at {CHROMIUM} (CI installs it: apt-get install chromium)"),
]


class Browser:
    """A headless Chromium and one page, spoken to in CDP over its debugging pipe."""

    def __init__(self, user_data_dir: Path):
        user_data_dir.mkdir(parents=True, exist_ok=True)
        self.log = user_data_dir.parent / f"{user_data_dir.name}-chromium.log"
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire_fds():  # in the child, before exec: its fd 3 reads our commands, fd 4 writes its answers
            a = fcntl.fcntl(to_chrome_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_chrome_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}", "about:blank"],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=False,
                                         preexec_fn=wire_fds)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._inbox: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH, height=900,
                  deviceScaleFactor=1, mobile=False)

    def _read(self):
        buf = b""
        while True:
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                self._inbox.put(None)
                return
            buf += chunk
            *messages, buf = buf.split(b"\0")
            for m in messages:
                self._inbox.put(json.loads(m))

    def _died(self) -> RuntimeError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        tail = self.log.read_text(errors="replace")[-2000:]
        return RuntimeError(f"Chromium closed its pipe (exit {code}); its log ends:\n{tail}")

    def _next(self, deadline: float) -> dict:
        try:
            msg = self._inbox.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            raise TimeoutError("Chromium did not answer in time") from None
        if msg is None:
            raise self._died()
        if "id" not in msg:
            self.events.append(msg)
        return msg

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        try:
            os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        except BrokenPipeError:
            raise self._died() from None
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            reply = self._next(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def wait_event(self, method: str, since: int) -> dict:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            for e in self.events[since:]:
                if e.get("method") == method and e.get("sessionId") == self.session:
                    return e
            self._next(deadline)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"]["value"]

    def open(self, url: str) -> list[dict]:
        """Navigate and wait for the load event; returns the events the page raised."""
        since = len(self.events)
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired", since)
        self.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        return self.events[since:]

    def screenshot(self) -> bytes:
        size = self.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        shot = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        return base64.b64decode(shot["data"])

    def close(self):
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)


MEASURE = """JSON.stringify({
  plots: [...document.querySelectorAll('svg[data-plot]')].map(s => {
    const r = s.getBoundingClientRect();
    const shapes = [...s.querySelectorAll('rect, line, polyline, circle, path')];
    const drawn = shapes.filter(e => { const b = e.getBoundingClientRect(); return b.width > 0 || b.height > 0; });
    const texts = [...s.querySelectorAll('text')].filter(e => e.getBoundingClientRect().width > 0);
    return {name: s.dataset.plot, width: r.width, height: r.height, drawn: drawn.length, texts: texts.length,
            notMeasured: s.classList.contains('not-measured'), text: s.textContent};
  }),
  verdict: (() => { const v = document.querySelector('[data-verdict]');
                    const r = v.getBoundingClientRect();
                    return {word: v.dataset.verdict, top: r.top, height: r.height,
                            background: getComputedStyle(v).backgroundColor}; })(),
  scripts: document.scripts.length,
  bodyText: document.body.innerText,
})"""


# Where each plot's labels landed: pairs of labels whose boxes overlap, labels past the plot's edge (cut
# off), and the plot's width against the page's content width.
LAYOUT = """JSON.stringify((() => {
  const main = document.querySelector('main'), cs = getComputedStyle(main);
  const content = main.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight);
  return {content, plots: [...document.querySelectorAll('svg[data-plot]')].map(s => {
    const r = s.getBoundingClientRect();
    const boxes = [...s.querySelectorAll('text')].map(t => ({t: t.textContent, b: t.getBoundingClientRect()}))
      .filter(x => x.b.width > 0);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
      const a = boxes[i].b, b = boxes[j].b;
      if (a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1)
        overlaps.push([boxes[i].t, boxes[j].t]);
    }
    const outside = boxes.filter(x => x.b.left < r.left - 0.5 || x.b.right > r.right + 0.5).map(x => x.t);
    return {name: s.dataset.plot, width: r.width, overlaps, outside};
  })};
})())"""


def _hostile(report: dict) -> dict:
    """A report whose strings try to become markup; CSP would log an error if any script slipped through."""
    r = copy.deepcopy(report)
    s = r["scenarios"][0]
    s["reason"] = '<script>console.error("escaped?")</script><img src=x onerror="console.error(1)"> & co'
    s["evidence"].append({"kind": "log", "text": "</pre><script>console.error(2)</script>", "http_status": None,
                          "at_s": None})
    r["target"]["notes"].append('<iframe src="http://127.0.0.1:9/"></iframe>')
    return r


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict:
    """Every fixture report (plus a hostile variant) written with write_reports and opened in one browser."""
    tmp = tmp_path_factory.mktemp("chromium")
    pages = {p.name: json.loads(p.read_text()) for p in REPORTS}
    pages["hostile.json"] = _hostile(pages["sample-report.json"])
    browser = Browser(tmp / "profile")
    results = {}
    try:
        for name, report in pages.items():
            paths = write_reports(report, tmp / name.removesuffix(".json"))
            events = browser.open(paths["html"].as_uri())
            measured = json.loads(browser.evaluate(MEASURE))
            measured["layout"] = json.loads(browser.evaluate(LAYOUT))
            shot = None
            if name == SCREENSHOT_REPORT:
                shot = tmp / "qualify.png"
                shot.write_bytes(browser.screenshot())
            results[name] = {"report": report, "events": events, "measured": measured, "screenshot": shot}
    finally:
        browser.close()
    return results


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
            out.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
        elif m == "Runtime.exceptionThrown":
            out.append(f"exception: {p['exceptionDetails'].get('text')}")
        elif m == "Log.entryAdded" and p["entry"]["level"] in ("error", "warning"):
            out.append(f"log {p['entry']['level']}: {p['entry']['text']}")
    return out


def test_pages_open_without_console_errors(rendered):
    for name, r in rendered.items():
        assert _errors(r["events"]) == [], name
        assert any(e.get("method") == "Page.loadEventFired" for e in r["events"]), name


def test_pages_make_no_network_request(rendered):
    for name, r in rendered.items():
        urls = [e["params"]["request"]["url"] for e in r["events"] if e.get("method") == "Network.requestWillBeSent"]
        assert urls, f"{name}: the page load itself should be seen"
        assert [u for u in urls if not u.startswith(("file:", "data:", "about:"))] == [], name


def test_every_plot_is_laid_out_and_drawn(rendered):
    for name, r in rendered.items():
        plots = {p["name"]: p for p in r["measured"]["plots"]}
        assert sorted(plots) == sorted(plot_names(r["report"])), name
        for plot in plots.values():
            where = f"{name}: {plot['name']}"
            assert plot["width"] > 300 and plot["height"] > 40, where
            assert plot["texts"] >= 1, where
            if plot["notMeasured"]:
                assert "not measured: " in plot["text"], where
                assert plot["drawn"] >= 2, where  # the white ground and the dashed box
            else:
                assert plot["drawn"] > 5, where


def test_verdict_is_first_and_coloured(rendered):
    colours = {"passed": "rgb(26, 127, 55)", "failed": "rgb(207, 34, 46)", "incomplete": "rgb(154, 103, 0)"}
    for name, r in rendered.items():
        v = r["measured"]["verdict"]
        assert v["word"] == r["report"]["verdict"], name
        assert v["top"] < 120 and v["height"] > 40, name
        assert v["background"] == colours[v["word"]], name


def test_hostile_strings_are_shown_as_text(rendered):
    r = rendered["hostile.json"]
    assert r["measured"]["scripts"] == 0
    assert '<script>console.error("escaped?")</script>' in r["measured"]["bodyText"]
    assert '<iframe src="http://127.0.0.1:9/"></iframe>' in r["measured"]["bodyText"]


def test_full_page_screenshot(rendered):
    shot = rendered[SCREENSHOT_REPORT]["screenshot"].read_bytes()
    width, height = _png_size(shot)
    assert width == WIDTH
    assert height > 2000  # the whole page, not the 900 px viewport
    assert len(shot) > 100_000
    if os.environ.get("V100PLAN_REFRESH_SCREENSHOT") == "1":
        SCREENSHOT.parent.mkdir(exist_ok=True)
        SCREENSHOT.write_bytes(shot)


def test_plots_use_the_full_width_and_no_label_overlaps_or_is_cut(rendered):
    """Every plot spans the page's content width; no two labels overlap (a value on a tick, p99 over max);
    no label, a "not measured" reason included, runs past the plot's edge where it would be cut mid-word."""
    for name, r in rendered.items():
        layout = r["measured"]["layout"]
        for plot in layout["plots"]:
            where = f"{name}: {plot['name']}"
            assert plot["width"] >= 0.98 * layout["content"], (where, plot["width"], layout["content"])
            assert plot["overlaps"] == [], where
            assert plot["outside"] == [], where
