"""The load scenario: N concurrent clients send M requests in all, mixing normal, streamed and
cancelled ones. N is the --clients option, raised to the service's max_concurrency where its /health says more (so
every sequence slot is used: concurrency.served_concurrency). Every request must end with the reference answer, a deliberate cancel, or a clear
429/503 carrying Retry-After (which the client honours before it tries again); none lost, none
answered twice, none wrong. Latency percentiles, tokens/s and one stream's decode speed are
measured, and set against the plan's prediction when a plan is given."""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter

from v100plan.accept.cases import Outcome, case, percentile
from v100plan.accept.concurrency import served_concurrency
from v100plan.accept.context import PROMPTS, Context

KINDS = ("normal",) * 12 + ("stream",) * 5 + ("cancel",) * 3   # 60 % / 25 % / 15 %
MAX_RETRIES = 30


def _timeout(ctx: Context) -> float:
    return 120 + ctx.options.requests * 3.0


def predicted_decode(plan: dict | None, strategy: str | None = None) -> float | None:
    """The plan's predicted single-stream decode speed for `strategy` (the one served, e.g. tp2 for the
    bundled two-rank engine), else for its recommended strategy."""
    if not plan:
        return None
    by_name = {s.get("name"): s for s in plan.get("strategies") or []}
    s = by_name.get(strategy) or by_name.get(plan.get("recommended")) or {}
    return float(s["decode_tok_s"]) if isinstance(s.get("decode_tok_s"), (int, float)) else None


class _Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.latencies: list[float] = []
        self.ttft: list[float] = []
        self.decode_tok_s: list[float] = []
        self.tokens = 0
        self.response_ids: Counter = Counter()
        self.samples: list[str] = []

    def add(self, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if detail and outcome not in ("correct", "cancelled") and len(self.samples) < 10:
                self.samples.append(f"{outcome}: {detail}")


def _retry_after(headers: dict) -> float | None:
    value = {k.lower(): v for k, v in headers.items()}.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _one(ctx: Context, i: int, tally: _Tally) -> None:
    kind = KINDS[i % len(KINDS)]
    prompt = list(PROMPTS.values())[i % len(PROMPTS)]
    n = ctx.options.load_max_tokens
    ref = ctx.refs.get(prompt, n)
    payload = ctx.payload(prompt, n, user=f"accept-load-{i}")
    t0 = time.monotonic()
    for _attempt in range(MAX_RETRIES):
        if kind == "normal":
            a = ctx.client.post("/v1/completions", payload, timeout_s=300)
            status, headers, body = a.status, a.headers, a.body
        else:
            s = ctx.client.stream("/v1/completions", payload, timeout_s=300,
                                  on_event=(lambda k, _ev: k >= 2) if kind == "cancel" else None)
            status, headers, body = s.status, s.headers, s.body
        if status in (429, 503):
            wait = _retry_after(headers)
            if wait is None:
                tally.add("error", f"request {i}: {status} without Retry-After")
                return
            tally.add(f"rejected_{status}")
            time.sleep(min(wait, 3.0))
            continue
        if status is None:
            tally.add("lost", f"request {i}: {(a.error if kind == 'normal' else s.transport_error)}")
            return
        if status != 200:
            tally.add("error", f"request {i}: {status} {str(body)[:120]}")
            return
        break
    else:
        tally.add("gave_up", f"request {i}: still refused after {MAX_RETRIES} tries")
        return
    elapsed = time.monotonic() - t0
    if kind == "normal":
        rid = a.body.get("id")
        ok = ctx.matches(ref, a.text(), a.token_ids())
        got = (a.body.get("usage") or {}).get("completion_tokens") or 0
    elif kind == "stream":
        rid = s.events[0][1].get("id") if s.events else None
        ok = s.done and not s.errors and ctx.matches(ref, s.text(), s.token_ids())
        got = len(s.token_events())
        times = [t for t, _ in s.token_events()]
        with tally.lock:
            if times:
                tally.ttft.append(times[0])
            if len(times) >= 3 and times[-1] > times[0]:
                tally.decode_tok_s.append((len(times) - 1) / (times[-1] - times[0]))
    else:  # cancelled on purpose after two events: what came must be a prefix of the reference
        rid = s.events[0][1].get("id") if s.events else None
        ok = s.cut_by_client and ctx.is_prefix(ref, s.text())
        got = 0
    with tally.lock:
        if rid:
            tally.response_ids[rid] += 1
        if ok and kind != "cancel":
            tally.latencies.append(elapsed)
            tally.tokens += got
    # Without local weights the reference is the server's own answer to the request alone: a batched
    # server may answer differently under load (floating point is not stable across batch sizes), which
    # is reported, but only a wrong answer against an exact reference is "wrong".
    miss = "wrong" if ctx.refs.exact else "differs"
    if kind == "cancel":
        tally.add("cancelled" if ok else miss, f"request {i}: {s.text()[:40]!r}")
    else:
        tally.add("correct" if ok else miss, f"request {i} ({kind}): {(a.text() if kind == 'normal' else s.text())[:40]!r}")


@case("load", "N concurrent clients x M requests (normal, streamed, cancelled): every request answered "
      "exactly once, correctly or with a clear 429/503 + Retry-After; latency and speed measured",
      group="load", timeout_s=_timeout)
def load(ctx: Context) -> Outcome:
    o = Outcome()
    opts = ctx.options
    tally = _Tally()
    counter = iter(range(opts.requests))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            try:
                _one(ctx, i, tally)
            except Exception as exc:  # noqa: BLE001 - one request's crash is an outcome, not the suite's
                tally.add("error", f"request {i}: {type(exc).__name__}: {exc}")

    # As many clients as the service decodes at once, at least: fewer would leave slots idle and measure less.
    slots = served_concurrency(ctx)["max_concurrency"]
    clients = max(opts.clients, slots or 0)
    if clients > opts.clients:
        o.note("load", f"{clients} clients, not --clients {opts.clients}: the service decodes up to {slots} requests "
                       "at once (its /health's max_concurrency)")
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0

    dupes = sum(c - 1 for c in tally.response_ids.values() if c > 1)
    outcomes = dict(tally.outcomes)
    outcomes["duplicate"] = dupes
    mix = Counter(KINDS[i % len(KINDS)] for i in range(opts.requests))
    ended = sum(outcomes.get(k, 0) for k in ("correct", "cancelled", "wrong", "differs", "lost", "error", "gave_up"))
    lats = tally.latencies
    served = round(statistics.median(tally.decode_tok_s), 2) if tally.decode_tok_s else None
    served_as = "tp2" if (ctx.target.engine or {}).get("tp") == 2 else None
    predicted = predicted_decode(ctx.plan, served_as)
    unavailable = {}
    if predicted is None:
        unavailable["predicted_decode_tok_s"] = "no plan was given" if not ctx.plan else \
            "the plan's recommended strategy has no decode speed"
    if served is None:
        unavailable["served_decode_tok_s"] = "no streamed request had three or more token events"
    ctx.shared["load"] = {
        "clients": clients, "requests": opts.requests, "served_max_concurrency": slots, "mix": dict(mix), "outcomes": outcomes,
        "latency_s": {k: (round(v, 4) if v is not None else None) for k, v in
                      (("p50", percentile(lats, 50)), ("p90", percentile(lats, 90)),
                       ("p99", percentile(lats, 99)), ("max", max(lats) if lats else None))},
        "latencies_s": [round(v, 4) for v in lats],
        "ttft_s": {"p50": round(percentile(tally.ttft, 50), 4), "p99": round(percentile(tally.ttft, 99), 4)}
        if tally.ttft else None,
        "tokens_per_s": round(tally.tokens / wall, 2) if wall > 0 else None,
        "served_decode_tok_s": served, "predicted_decode_tok_s": predicted,
        "served_over_predicted": round(served / predicted, 3) if served and predicted else None,
        "wall_s": round(wall, 3), "unavailable": unavailable,
    }
    o.metrics.update({"wall_s": round(wall, 3), **{f"outcome_{k}": v for k, v in outcomes.items()}})
    o.check(ended == opts.requests, f"{opts.requests - ended} of {opts.requests} requests have no ending")
    for bad in ("wrong", "lost", "error", "gave_up", "duplicate"):
        o.check(not outcomes.get(bad), f"{outcomes.get(bad)} {bad}")
    if outcomes.get("differs"):
        o.warn(f"{outcomes['differs']} answers under load differ from the server's answer to the same request "
               "alone; with no local weights there is no exact reference, and batched servers are not "
               "bit-stable across batch sizes")
    for sample in tally.samples:
        o.note("request", sample)
    return o
