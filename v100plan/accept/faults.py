"""Fault scenarios against the bundled engine, through its fault control (`serve
--enable-fault-injection`): each fault lands on a running streamed request, several times.

For every repetition: the in-flight request must end with a clear error (an SSE error event and
[DONE], or, when the proxy itself dies, a cut connection) and never a token that differs from the
reference; the service must come back by itself. Time to detect = injection -> the first sign the
service saw it (the request's error, or /health not 200); time to recover = injection -> the
first exact answer afterwards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from engine.service.causes import SCENARIOS
from v100plan.accept.cases import Outcome, Repetition, case
from v100plan.accept.context import PROMPTS, REF_TOKENS, Context
from v100plan.accept.events import MISSING, Events
from v100plan.accept.http import Stream

G = "fault"
FAULT_TOKENS = 200      # the in-flight request's least length: still running when the fault lands
FAULT_STREAM_S = 1.0    # ... and at least this long at the service's measured pace (a fast card's 200
                        # tokens end within ~50 ms, before an injection through the busy proxy lands)

# How to switch the fault control on, as the waivers say it: a deployment gets it from deploy's flag.
FAULT_CONTROL_HOW = "deploy it with `v100plan deploy --enable-fault-injection` (or start `serve --enable-fault-injection` by hand)"


def size_fault_request(ctx: Context) -> str:
    """Measure the service's pace on one short stream and size the fault scenarios' in-flight request
    (``ctx.fault_tokens``) to last FAULT_STREAM_S at that pace, at least FAULT_TOKENS tokens and within
    half the context limit. Returns a note for the report."""
    s = ctx.client.stream("/v1/completions", ctx.payload(PROMPTS["story"], 32), timeout_s=120)
    times = [t for t, _ev in s.token_events()]
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    if s.errors or len(gaps) < 4:
        ctx.fault_tokens = FAULT_TOKENS
        return f"the fault scenarios' in-flight request: {FAULT_TOKENS} tokens (the pace could not be measured)"
    per_token = max(gaps[len(gaps) // 2], 1e-5)
    cap = (ctx.max_context or 4 * FAULT_TOKENS) // 2
    ctx.fault_tokens = max(FAULT_TOKENS, min(cap, int(FAULT_STREAM_S / per_token) + 1))
    return (f"the fault scenarios' in-flight request: {ctx.fault_tokens} tokens (the service streams a token "
            f"every {per_token * 1e3:.2f} ms; sized to last {FAULT_STREAM_S:g} s, at least {FAULT_TOKENS}, "
            f"at most half the context)")


def _needs_control(ctx: Context) -> str | None:
    if not ctx.is_engine:
        return f"fault injection needs the bundled engine's control interface; this server is " \
               f"{ctx.server or 'another make'} (faults are only run against v100plan's engine)"
    if not ctx.fault_control:
        return ("the engine's fault control does not answer: " + FAULT_CONTROL_HOW + ", and reach it from loopback")
    return None


def _needs_supervisor(ctx: Context) -> str | None:
    why = _needs_control(ctx)
    if why:
        return why
    return None if ctx.target.supervised else ("the proxy runs without a supervisor here, so nothing would "
                                                  "restart it (give --supervised when one does)")


def _timeout(ctx: Context) -> float:
    return ctx.options.fault_repeats * (ctx.options.recover_timeout_s + 30)


def _run_fault(ctx: Context, inject: Callable[[Context], tuple[bool, str]], *, proxy_dies: bool = False,
               log_check: Callable[[Context, list[dict]], str | None] | None = None) -> Outcome:
    o = Outcome()
    for i in range(1, ctx.options.fault_repeats + 1):
        rep = _repetition(ctx, i, inject, proxy_dies, log_check, o)
        o.repetitions.append(rep)
        if rep.status == "error":
            break
    detect = [r.time_to_detect_s for r in o.repetitions]
    recover = [r.time_to_recover_s for r in o.repetitions]
    o.metrics["time_to_detect_s"] = detect
    o.metrics["time_to_recover_s"] = recover
    return o


def _repetition(ctx: Context, index: int, inject, proxy_dies: bool, log_check, o: Outcome) -> Repetition:
    rep = Repetition(index)
    before = ctx.wait_healthy(ctx.options.recover_timeout_s)
    if before is None:
        rep.status, rep.detail = "error", "the service was not healthy before the injection"
        return rep
    gen0 = before.get("generation")
    ref = ctx.refs.get(PROMPTS["story"], ctx.fault_tokens)
    events = Events(ctx)
    log_mark = events.mark() if log_check is not None else None
    started = threading.Event()
    box: dict[str, Stream] = {}

    def request() -> None:
        box["s"] = ctx.client.stream("/v1/completions", ctx.payload(PROMPTS["story"], ctx.fault_tokens),
                                     on_event=lambda n, _ev: started.set() if n >= 2 else None, timeout_s=120)
        started.set()

    th = threading.Thread(target=request, daemon=True)
    th.start()
    if not started.wait(60) or "s" in box and not box["s"].events:
        rep.status, rep.detail = "error", "the in-flight request produced no tokens to interrupt"
        th.join(5)
        return rep
    t0 = time.monotonic()
    ok, what = inject(ctx)
    rep.mark(0.0, f"injected: {what}")
    if not ok:
        rep.status, rep.detail = "error", f"the injection was refused: {what}"
        th.join(60)
        return rep

    # Watch /health until a new generation answers, then ask for an exact answer.
    t_down = t_up = None
    deadline = t0 + ctx.options.recover_timeout_s
    last = None
    while time.monotonic() < deadline:
        h = ctx.health(timeout_s=1.0)
        now = time.monotonic() - t0
        state = h.status if h.status is not None else "no answer"
        gen = h.body.get("generation") if h.status == 200 and isinstance(h.body, dict) else None
        if state != last and not (state == 200 and gen == gen0):
            rep.mark(now, f"/health {state}" + (f" (generation {gen})" if gen is not None else ""))
            last = state
        if t_down is None and (h.status != 200 or (gen is not None and gen0 is not None and gen > gen0)):
            t_down = now
        if h.status == 200 and gen is not None and gen0 is not None and gen > gen0:
            t_up = now
            break
        time.sleep(0.05)
    th.join(60)
    s = box.get("s")
    detect = [t for t in (t_down,) if t is not None]
    if s is not None and s.first_error_s is not None:
        t_err = s.t_sent + s.first_error_s - t0
        rep.mark(max(t_err, 0.0), f"the request got an error: {(s.errors[0].get('message') or '')[:80]}")
        detect.append(max(t_err, 0.0))
    elif s is not None and s.cut:
        t_cut = s.t_sent + s.t_end_s - t0
        rep.mark(max(t_cut, 0.0), "the request's connection was cut")
        detect.append(max(t_cut, 0.0))
    rep.time_to_detect_s = min(detect) if detect else None

    if s is None:
        rep.fail("the in-flight request never returned")
    else:
        if s.done and not s.errors and s.finish_reason() == "length":
            rep.fail("the in-flight request finished normally: the fault did not reach it")
        elif proxy_dies:
            if not (s.cut or s.errors):
                rep.fail("the request neither got an error nor a cut connection")
        else:
            if not s.errors:
                rep.fail(f"the in-flight request ended without an error event (status {s.status}, "
                         f"done={s.done}, cut={s.cut})")
            elif not s.done:
                rep.fail("the error event was not followed by [DONE]")
            codes = {str(e.get("code")) for e in s.errors}
            if codes and "503" not in codes:
                rep.fail(f"the error event carries code {sorted(codes)}, expected 503 (retry later)")
        if not ctx.is_prefix(ref, s.text()):
            rep.fail(f"a token differs from the reference before the error: {s.text()[:80]!r}")
        rep.detail = f"{len(s.token_events())} events before the fault's end"

    if t_up is None:
        rep.fail(f"the service did not come back within {ctx.options.recover_timeout_s:g} s")
        return rep
    a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["fox"], REF_TOKENS), timeout_s=60)
    fox = ctx.refs.get(PROMPTS["fox"])
    if a.ok and ctx.matches(fox, a.text(), a.token_ids()):
        rep.time_to_recover_s = time.monotonic() - t0
        rep.mark(rep.time_to_recover_s, "first exact answer")
    else:
        rep.fail(f"the first answer after recovery was not exact ({a.status}: {a.text()[:40]!r})")
    if log_check is not None:
        found = _wait_events(events, log_mark, log_check, ctx)
        if found is None:
            if f"the failure cause was not checked: {MISSING}" not in o.warnings:
                o.warn(f"the failure cause was not checked: {MISSING}")
        elif log_check(ctx, found):
            rep.fail(log_check(ctx, found))
    return rep


def _wait_events(events: Events, mark, log_check, ctx: Context, wait_s: float = 5.0) -> list[dict] | None:
    """The events after `mark`, re-read for up to `wait_s` until `log_check` is satisfied (a log
    written by another process may lag the service's answer by a moment)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = events.after(mark)
        if found is None or not log_check(ctx, found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def _rank_action(action: str, rank: int) -> Callable[[Context], tuple[bool, str]]:
    def inject(ctx: Context) -> tuple[bool, str]:
        a = ctx.inject(action, rank)
        return a.status == 200, f"{action} rank {rank}" if a.status == 200 else f"{a.status}: {a.error_message()}"
    return inject


def _failure_cause(*causes: str) -> Callable[[Context, list[dict]], str | None]:
    """The service log must record the pair's failure with one of `causes`."""
    def check(_ctx: Context, events: list[dict]) -> str | None:
        found = [e.get("cause") for e in events if e.get("event") == "rank_failure"]
        if not found:
            return "the service log records no rank_failure for this fault"
        return None if found[0] in causes else f"the service log gives cause {found[0]!r}, expected {causes}"
    return check


# The engine's scenario table (engine/service/causes.py, stdlib only): the action, the rank, and
# every failure cause that is a correct detection of the fault.
for _sc in SCENARIOS:
    case(_sc.key, _sc.description, group=G, timeout_s=_timeout, applicable=_needs_control)(
        lambda ctx, sc=_sc: _run_fault(ctx, _rank_action(sc.action, sc.rank),
                                       log_check=_failure_cause(*(c.value for c in sc.detected_by))))


def _kill_proxy(ctx: Context) -> tuple[bool, str]:
    a = ctx.inject("kill_proxy")
    return a.status == 200, "SIGKILL the proxy" if a.status == 200 else f"{a.status}: {a.error_message()}"


@case("kill_proxy", "SIGKILL the proxy mid-stream: the connection is cut, the supervisor starts a new proxy",
      group=G, timeout_s=_timeout, applicable=_needs_supervisor)
def kill_proxy(ctx: Context) -> Outcome:
    return _run_fault(ctx, _kill_proxy, proxy_dies=True)


def _storm(ctx: Context) -> tuple[bool, str]:
    a = ctx.inject("fail_starts", count=100)
    if a.status != 200:
        return False, f"fail_starts: {a.status}: {a.error_message()}"
    b = ctx.inject("kill", 0)
    return b.status == 200, "every rank start fails from now on, then SIGKILL rank 0" if b.status == 200 \
        else f"kill: {b.status}: {b.error_message()}"


def _exited_at_cap(_ctx: Context, events: list[dict]) -> str | None:
    """The proxy that gave up logged its exit at the cap (the service log), or the proxy its
    supervisor started afresh reports it (previous_exit: the only trace /control/events still has)."""
    exits = [e for e in events if e.get("event") in ("exit", "previous_exit")]
    if not exits:
        return "the service's events record no exit at the restart cap"
    if exits[0].get("code") in (0, None):
        return "serve exited 0 at the restart cap (documented: non-zero)"
    if exits[0].get("cause") != "selftest":
        return f"the exit at the cap gives cause {exits[0].get('cause')!r}, expected 'selftest' (the failed starts)"
    return None


@case("restart_storm", "every rank start fails: the restarts reach the cap, serve reports itself down and "
      "exits non-zero, the supervisor starts it afresh", group=G, timeout_s=_timeout, applicable=_needs_supervisor)
def restart_storm(ctx: Context) -> Outcome:
    return _run_fault(ctx, _storm, proxy_dies=False, log_check=_exited_at_cap)
