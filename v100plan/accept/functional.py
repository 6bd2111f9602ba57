"""Functional scenarios: what every OpenAI-compatible service must answer, and what the bundled
engine must show about its two ranks. Each case checks one behaviour a user relies on."""

from __future__ import annotations

import re
import time

from v100plan.accept.cases import Outcome, case, percentile
from v100plan.accept.context import PROMPTS, REF_TOKENS, Context
from v100plan.accept.serving import served_draft_tokens

F = "functional"


def _engine_only(ctx: Context) -> str | None:
    return None if ctx.is_engine else "needs the bundled engine (its v100plan extension); this server is " \
                                      f"{ctx.server or 'another make'}"


def _needs_rank_logs(ctx: Context) -> str | None:
    why = _engine_only(ctx)
    if why:
        return why
    return None if ctx.target.read_rank_logs else ("the rank logs are not reachable from here: give accept --state-dir DIR (the engine's state "
                                                 "directory on this machine), or --host for a deployed engine")


def _expect_length(o: Outcome, ctx: Context, finish: str | None, tokens: int | None, n: int) -> None:
    """With ignore_eos the answer is exactly n tokens, finish 'length'. Without it (a server that refuses
    the extension) an end-of-sequence token may come first: then 'stop' with fewer tokens is right too."""
    if not ctx.ignore_eos and finish == "stop" and tokens is not None and tokens <= n:
        o.warn(f"the answer ended at end-of-sequence after {tokens} of {n} tokens; truncation not shown")
        return
    o.check(finish == "length", f"finish_reason {finish!r}, expected 'length'")
    o.check(tokens == n, f"usage.completion_tokens {tokens}, expected {n}")


def _expect_ref(o: Outcome, ctx: Context, what: str, ref, text: str, ids) -> None:
    ok = ctx.matches(ref, text, ids)
    o.check(ok, f"{what}: the answer differs from the reference ({ref.source}): got {text[:60]!r}, "
                f"expected {ref.text[:60]!r}")


@case("completion", "a plain greedy completion equals the reference answer, finish_reason 'length'",
      group=F, timeout_s=120)
def completion(ctx: Context) -> Outcome:
    o = Outcome()
    ref = ctx.refs.get(PROMPTS["fox"])
    a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["fox"], REF_TOKENS))
    o.note("http", f"POST /v1/completions -> {a.status}", a.status, a.elapsed_s)
    if o.check(a.ok, f"answered {a.status}: {a.error_message()}"):
        _expect_ref(o, ctx, "completion", ref, a.text(), a.token_ids())
        _expect_length(o, ctx, a.finish_reason(), (a.body.get("usage") or {}).get("completion_tokens"), REF_TOKENS)
    o.metrics["latency_s"] = round(a.elapsed_s, 4)
    return o


@case("chat", "a chat completion answers with an assistant message, the same one twice (greedy)",
      group=F, timeout_s=120)
def chat(ctx: Context) -> Outcome:
    o = Outcome()
    body = {"model": ctx.model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            "temperature": 0, **({"ignore_eos": True} if ctx.ignore_eos else {})}
    first = ctx.client.post("/v1/chat/completions", body)
    o.note("http", f"POST /v1/chat/completions -> {first.status}", first.status, first.elapsed_s)
    if not o.check(first.ok, f"answered {first.status}: {first.error_message()}"):
        return o
    msg = (first.body.get("choices") or [{}])[0].get("message") or {}
    o.check(msg.get("role") == "assistant", f"message role {msg.get('role')!r}, expected 'assistant'")
    o.check(isinstance(msg.get("content"), str), "message content is not a string")
    o.check(first.body.get("object") == "chat.completion", f"object {first.body.get('object')!r}")
    again = ctx.client.post("/v1/chat/completions", body)
    o.check(again.ok and again.text() == first.text(), "the same greedy chat request gave another answer")
    return o


@case("stream", "a streamed completion sends one event per token as it is generated; same text as "
      "unstreamed; the gaps between events are measured", group=F, timeout_s=180)
def stream(ctx: Context) -> Outcome:
    o = Outcome()
    n = 32
    ref = ctx.refs.get(PROMPTS["story"], n)
    s = ctx.client.stream("/v1/completions", ctx.payload(PROMPTS["story"], n))
    ended = s.done or (s.finish_reason() is not None and not s.errors and s.transport_error is None)
    if not o.check(s.status == 200 and ended, f"stream answered {s.status}, done={s.done}, "
                                              f"errors={s.errors}, transport={s.transport_error}"):
        return o
    if not s.done:
        o.warn("the stream ended with its finish_reason chunk and a closed connection, without 'data: [DONE]'")
    _expect_ref(o, ctx, "stream", ref, s.text(), s.token_ids())
    if ctx.ignore_eos:
        o.check(s.finish_reason() == "length", f"finish_reason {s.finish_reason()!r}, expected 'length'")
    times = [t for t, _ in s.token_events()]
    gaps_ms = [round((b - a) * 1000, 3) for a, b in zip(times, times[1:])]
    o.metrics.update({
        "token_events": len(times), "tokens": n, "stream_event_gaps_ms": gaps_ms,
        "first_event_s": round(times[0], 4) if times else None,
        "event_gap_ms_p50": percentile(gaps_ms, 50), "event_gap_ms_p99": percentile(gaps_ms, 99),
        "event_gap_ms_max": max(gaps_ms) if gaps_ms else None,
    })
    # One event per token: a few tokens may be held back while they form an incomplete UTF-8
    # character, so at least 90 % of the tokens arrive in events of their own.
    produced = n if ctx.ignore_eos else (ref.tokens or n)
    o.check(len(times) >= 0.9 * produced, f"{len(times)} events carried text for {produced} tokens: the stream "
                                          "is not sent token by token")
    if times and len(times) > 2:
        spread_s = times[-1] - times[0]
        o.check(spread_s > 0, "every event arrived at the same moment: the answer was buffered, not streamed")
    return o


@case("seeded_sample", "a sampled request (temperature 0.9, seed 4242) gives the same text twice "
      "(and the reference's, with local weights)", group=F, timeout_s=120)
def seeded(ctx: Context) -> Outcome:
    o = Outcome()
    body = ctx.payload(PROMPTS["once"], REF_TOKENS, temperature=0.9, seed=4242)
    a, b = ctx.client.post("/v1/completions", body), ctx.client.post("/v1/completions", body)
    if not o.check(a.ok and b.ok, f"answered {a.status}/{b.status}: {a.error_message() or b.error_message()}"):
        return o
    o.check(a.text() == b.text(), f"the same seed gave two answers: {a.text()[:40]!r} vs {b.text()[:40]!r}")
    if ctx.refs.exact and ctx.is_engine and served_draft_tokens(ctx) is None:
        o.warn("the service speculates with a draft count it does not say: no TP1 run draws the same samples")
    elif ctx.refs.exact and ctx.is_engine:
        ref = ctx.refs.get(PROMPTS["once"], REF_TOKENS, 0.9, 4242)
        _expect_ref(o, ctx, "seeded sample", ref, a.text(), a.token_ids())
    return o


@case("max_tokens", "max_tokens truncates: exactly that many tokens, finish_reason 'length'",
      group=F, timeout_s=60)
def max_tokens(ctx: Context) -> Outcome:
    o = Outcome()
    a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["begin"], 5))
    if o.check(a.ok, f"answered {a.status}: {a.error_message()}"):
        _expect_length(o, ctx, a.finish_reason(), (a.body.get("usage") or {}).get("completion_tokens"), 5)
    return o


@case("stop_sequence", "a stop sequence ends the text just before it, finish_reason 'stop'",
      group=F, timeout_s=120)
def stop_sequence(ctx: Context) -> Outcome:
    o = Outcome()
    ref = ctx.refs.get(PROMPTS["fox"])
    stop = _pick_stop(ref.text)
    if stop is None:
        o.warn(f"the reference text {ref.text!r} has no substring usable as a stop sequence")
        return o
    a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["fox"], REF_TOKENS, stop=[stop]))
    if o.check(a.ok, f"answered {a.status}: {a.error_message()}"):
        want = ref.text[: ref.text.index(stop)]
        o.check(a.text() == want, f"stop {stop!r}: got {a.text()!r}, expected {want!r}")
        o.check(a.finish_reason() == "stop", f"finish_reason {a.finish_reason()!r}, expected 'stop'")
    o.metrics["stop"] = stop
    return o


def _pick_stop(text: str) -> str | None:
    """A 2-character piece from the middle of `text` whose first occurrence is past the start."""
    for i in range(len(text) // 2, len(text) - 2):
        piece = text[i:i + 2]
        if piece.strip() and text.index(piece) > 0:
            return piece
    return None


def _request_lines(text: str) -> dict[str, dict]:
    out = {}
    for m in re.finditer(r"request (\S+) finish=(\S+) steps=(\d+) tokens=(\d+) hash=([0-9a-f]+)", text):
        out[m.group(1)] = {"finish": m.group(2), "steps": int(m.group(3)), "tokens": int(m.group(4)),
                           "hash": m.group(5)}
    return out


def _cancelled_in_both(ctx: Context, before: set[str], timeout_s: float = 20) -> tuple[str, dict, dict] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        logs = ctx.rank_logs()
        r0, r1 = _request_lines(logs.get(0, "")), _request_lines(logs.get(1, ""))
        for rid in set(r0) - before:
            if r0[rid]["finish"] == "cancelled" and rid in r1:
                return rid, r0[rid], r1[rid]
        time.sleep(0.1)
    return None


def _still_exact(o: Outcome, ctx: Context) -> None:
    ref = ctx.refs.get(PROMPTS["fox"])
    a = ctx.client.post("/v1/completions", ctx.payload(PROMPTS["fox"], REF_TOKENS))
    o.check(a.ok and ctx.matches(ref, a.text(), a.token_ids()),
            f"the next request after it was not exact ({a.status}: {a.text()[:40]!r})")


@case("stream_cancel", "the client cuts a stream mid-way: both ranks stop on the same step (from both rank "
      "logs) and the next answer is exact", group=F, timeout_s=120, applicable=_needs_rank_logs)
def stream_cancel(ctx: Context) -> Outcome:
    o = Outcome()
    before = set(_request_lines(ctx.rank_logs().get(0, "")))
    s = ctx.client.stream("/v1/completions", ctx.payload(PROMPTS["story"], 400), on_event=lambda n, _ev: n >= 3)
    o.check(s.cut_by_client and s.status == 200, f"could not cut the stream after 3 events ({s.status})")
    found = _cancelled_in_both(ctx, before)
    if o.check(found is not None, "no request line with finish=cancelled in rank 0's log within 20 s"):
        rid, l0, l1 = found
        o.note("rank_log", f"rank 0: request {rid} {l0}")
        o.note("rank_log", f"rank 1: request {rid} {l1}")
        o.check(l1["finish"] == "cancelled", f"rank 1 finished request {rid} as {l1['finish']}")
        o.check(l0["steps"] == l1["steps"] and l0["tokens"] == l1["tokens"],
                f"the ranks stopped on different steps: rank 0 {l0['steps']}/{l0['tokens']}, "
                f"rank 1 {l1['steps']}/{l1['tokens']}")
        o.check(l0["tokens"] < 400, "the request ran to its end: the cancel did not reach the ranks")
        o.metrics["cancelled_after_tokens"] = l0["tokens"]
    _still_exact(o, ctx)
    return o


@case("gone_in_prefill", "the client leaves during prefill: both ranks cancel the request on the same step and "
      "the next answer is exact", group=F, timeout_s=120, applicable=_needs_rank_logs)
def gone_in_prefill(ctx: Context) -> Outcome:
    o = Outcome()
    before = set(_request_lines(ctx.rank_logs().get(0, "")))
    # At most one token per character (byte-level tokenizers): 5-character words filling ~80 % of the
    # context stay under the limit and take long enough to prefill that the client leaves during it.
    words = int((ctx.max_context or 4096) * 0.8) // 5
    # When to leave: the same prompt answered with one token measures prefill on this service (on a fast
    # card ~0.1 s, on a CPU seconds); the client leaves at 40 % of it, at most 0.15 s after sending.
    timed = []
    for _ in range(2):
        t0 = time.monotonic()
        b = ctx.client.post("/v1/completions", ctx.payload("word " * words, 1), timeout_s=120)
        if not b.ok:
            o.check(False, f"the long prompt with one token was refused ({b.status}: {b.error_message()})")
            return o
        timed.append(time.monotonic() - t0)
    leave_s = min(0.15, 0.4 * min(timed))
    o.metrics["prefill_with_one_token_s"] = round(min(timed), 4)
    o.metrics["client_left_after_s"] = round(leave_s, 4)
    a = ctx.client.post("/v1/completions", ctx.payload("word " * words, 64), timeout_s=leave_s)
    o.check(a.status is None, f"the request answered {a.status} before the client left after {leave_s:.3f} s: "
                              f"prefill (with one token: {min(timed):.3f} s) was too quick to leave during it")
    found = _cancelled_in_both(ctx, before)
    if o.check(found is not None, "no request line with finish=cancelled in the rank logs within 20 s"):
        rid, l0, l1 = found
        o.note("rank_log", f"request {rid}: rank 0 {l0}, rank 1 {l1}")
        # The proxy notices the hang-up at its next look at the connection: a token or two may be
        # sampled by then, never the whole request.
        o.check(l0["tokens"] < 64, "the request ran to its end after the client left")
        o.check(l0["steps"] == l1["steps"] and l0["tokens"] == l1["tokens"],
                f"the ranks stopped on different steps: {l0['steps']}/{l0['tokens']} vs {l1['steps']}/{l1['tokens']}")
        o.metrics["tokens_after_leaving"] = l0["tokens"]
    _still_exact(o, ctx)
    return o


def _needs_context(ctx: Context) -> str | None:
    return None if ctx.max_context else "the server does not say its context limit (no max_model_len in /v1/models)"


@case("overlong_prompt", "a prompt longer than the context limit is refused with 400 and a message",
      group=F, timeout_s=60, applicable=_needs_context)
def overlong(ctx: Context) -> Outcome:
    o = Outcome()
    a = ctx.client.post("/v1/completions", ctx.payload("word " * (ctx.max_context + 64), 4))
    o.note("http", f"{ctx.max_context + 64} words -> {a.status}: {a.error_message()[:200]}", a.status)
    o.check(a.status == 400, f"answered {a.status}, expected 400")
    o.check(bool(a.error_message()), "the 400 carries no error message")
    return o


_BAD_INPUTS = [
    # (what, path, raw body or JSON, the field the answer must name or None)
    ("malformed JSON", "/v1/completions", b'{"model": "m", "prompt": "hi", "max_tokens": ', None),
    ("max_tokens as a word", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("temperature as a word", "/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"},
     "temperature"),
    ("chat without messages", "/v1/chat/completions", {"max_tokens": 4}, "messages"),
]


@case("bad_input", "malformed JSON and wrong types answer 4xx with a JSON error naming the field",
      group=F, timeout_s=60)
def bad_input(ctx: Context) -> Outcome:
    o = Outcome()
    for what, path, body, field in _BAD_INPUTS:
        if isinstance(body, dict):
            a = ctx.client.post(path, {"model": ctx.model, **body})
        else:
            a = ctx.client.request("POST", path, content=body, headers={"Content-Type": "application/json"})
        o.note("http", f"{what} -> {a.status}: {a.error_message()[:160]}", a.status)
        if not o.check(a.status is not None and 400 <= a.status < 500, f"{what}: answered {a.status}, expected 4xx"):
            continue
        if field is not None:
            said = f"{a.error_message()} {(a.body or {}).get('error', {}).get('param') if isinstance(a.body, dict) else ''}"
            if field not in said and field not in str(a.body):
                o.warn(f"{what}: the error does not name {field!r}")
    return o


def _needs_key(ctx: Context) -> str | None:
    return None if ctx.target.api_key else "the service was given no API key, so there is nothing to refuse"


@case("auth", "a missing or wrong API key is refused with 401", group=F, timeout_s=60, applicable=_needs_key)
def auth(ctx: Context) -> Outcome:
    o = Outcome()
    for what, headers in (("no key", {"Authorization": ""}), ("a wrong key", {"Authorization": "Bearer wrong-key"})):
        a = ctx.client.request("POST", "/v1/completions", json_body=ctx.payload("hi", 2), headers=headers)
        o.note("http", f"{what} -> {a.status}", a.status)
        o.check(a.status == 401, f"{what}: answered {a.status}, expected 401")
    return o


def _needs_openai(ctx: Context) -> str | None:
    try:
        import openai  # noqa: F401
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and missing != "openai":  # installed, but something it imports is not
            return (f"the openai package cannot be imported: it needs {missing!r}, which is not installed "
                    "(pip install 'v100plan[accept]')")
        return "the openai package is not installed (pip install 'v100plan[accept]')"
    return None


@case("openai_client", "the official openai Python client: completion, chat and a stream end to end",
      group=F, timeout_s=120, applicable=_needs_openai)
def openai_client(ctx: Context) -> Outcome:
    import openai

    o = Outcome()
    client = openai.OpenAI(base_url=ctx.target.endpoint.rstrip("/") + "/v1", api_key=ctx.target.api_key or "none",
                           max_retries=0, timeout=60)
    extra = {"ignore_eos": True} if ctx.ignore_eos else {}
    try:
        ref = ctx.refs.get(PROMPTS["fox"])
        c = client.completions.create(model=ctx.model, prompt=PROMPTS["fox"], max_tokens=REF_TOKENS, temperature=0,
                                      extra_body=extra)
        o.check(c.choices[0].text == ref.text, f"completion text {c.choices[0].text[:40]!r} differs from the reference")
        ch = client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=4, temperature=0)
        o.check(isinstance(ch.choices[0].message.content, str), "the chat answer has no content")
        pieces = [ev.choices[0].text for ev in client.completions.create(
            model=ctx.model, prompt=PROMPTS["fox"], max_tokens=REF_TOKENS, temperature=0, stream=True,
            extra_body=extra) if ev.choices]
        o.check("".join(pieces) == ref.text, "the streamed text differs from the reference")
        o.metrics["stream_chunks"] = len(pieces)
    except openai.OpenAIError as exc:
        o.check(False, f"the openai client raised {type(exc).__name__}: {str(exc)[:200]}")
    finally:
        client.close()
    return o


def needs_exact_tp1(ctx: Context) -> str | None:
    """Why the served answers cannot be compared token for token with a TP1 run here, or None."""
    if ctx.refs.half_precision:
        return (f"served in {ctx.refs.half_precision}: TP2's split sums round differently from one card's, so "
                "tokens equal TP1's only in float32")
    if not ctx.refs.exact:
        return ("the served weights are not on this machine, so there is no TP1 run to compare with: give "
                "accept --model-dir DIR (the served model's directory here)")
    return None


def _needs_tp2_reference(ctx: Context) -> str | None:
    why = _engine_only(ctx) or needs_exact_tp1(ctx)
    if why:
        return why
    if (ctx.target.engine or {}).get("tp", 2) != 2:
        return "the service runs one rank (TP1)"
    return None


@case("tp2_equals_tp1", "TP2 answers equal the TP1 reference token for token, for every reference prompt",
      group=F, timeout_s=300, applicable=_needs_tp2_reference)
def tp2_equals_tp1(ctx: Context) -> Outcome:
    o = Outcome()
    for key, prompt in PROMPTS.items():
        ref = ctx.refs.get(prompt)
        a = ctx.client.post("/v1/completions", ctx.payload(prompt, REF_TOKENS))
        if o.check(a.ok, f"{key}: answered {a.status}"):
            o.check(a.token_ids() == ref.token_ids, f"{key}: TP2 {a.token_ids()} vs TP1 {ref.token_ids}")
    o.metrics["prompts"] = len(PROMPTS)
    return o


@case("rank_logs_agree", "the two ranks' logs agree request by request (finish, steps, tokens, token hash)",
      group=F, timeout_s=60, applicable=_needs_rank_logs)
def rank_logs_agree(ctx: Context) -> Outcome:
    o = Outcome()
    logs = ctx.rank_logs()
    r0, r1 = _request_lines(logs.get(0, "")), _request_lines(logs.get(1, ""))
    o.check(len(r0) > 0, "rank 0's log has no request lines")
    only0, only1 = sorted(set(r0) - set(r1)), sorted(set(r1) - set(r0))
    o.check(not only0 and not only1, f"requests in one log only: rank 0 {only0[:5]}, rank 1 {only1[:5]}")
    differ = [rid for rid in set(r0) & set(r1) if r0[rid] != r1[rid]]
    o.check(not differ, f"{len(differ)} requests differ between the ranks, e.g. "
                        f"{[(rid, r0[rid], r1[rid]) for rid in differ[:2]]}")
    o.metrics["requests_compared"] = len(set(r0) & set(r1))
    return o
