"""Requests decoded together answer what each answers alone: the ``concurrent_equals_solo`` scenario.

The service says how many requests it decodes at once in its keyed /health (``max_concurrency``, and in the bundled
engine ``concurrency``: the bound that chose it). With N > 1 the scenario sends N greedy conversations (completions
and chats, streamed and not, prompts and lengths that differ) one at a time first, then all N at once, and every
answer must equal its solo answer token for token (text, and the engine's token ids where it gives them). A service
that decodes one request at a time has no batch to compare: the scenario is waived with the reason /health gives.
The load scenario uses the same figure for its client count (load.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

from v100plan.accept import functional  # noqa: F401 - registered first: the plain functional cases come first
from v100plan.accept.cases import Outcome, case
from v100plan.accept.context import Context

F = "functional"
TOPICS = ("the sea", "a clock", "winter", "a red fox", "bridges", "the moon", "bread", "a violin")


def served_concurrency(ctx: Context) -> dict:
    """{"max_concurrency": N or None, "bound", "why"} from the service's keyed /health, read once per run."""
    if "concurrency" not in ctx.shared:
        h = ctx.health(timeout_s=10)
        body = h.body if h.status == 200 and isinstance(h.body, dict) else {}
        n = body.get("max_concurrency")
        said = body.get("concurrency") if isinstance(body.get("concurrency"), dict) else {}
        ctx.shared["concurrency"] = {
            "max_concurrency": n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None,
            "bound": said.get("bound"), "why": said.get("why")}
    return ctx.shared["concurrency"]


def _applicable(ctx: Context) -> str | None:
    c = served_concurrency(ctx)
    n = c["max_concurrency"]
    if n is None:
        return ("the server does not say how many requests it decodes at once (no max_concurrency in its /health), "
                "so there is no batch size to check")
    if n < 2:
        said = f" (bound {c['bound']}: {c['why']})" if c.get("bound") else ""
        return (f"the service decodes one request at a time{said}: there is no batch to compare with; a service "
                "started with --max-concurrency N (N > 1) is checked")
    return None


def _timeout(ctx: Context) -> float:
    return 180 + 6 * (served_concurrency(ctx)["max_concurrency"] or 2)


@dataclasses.dataclass
class Request:
    index: int
    path: str
    body: dict[str, Any]
    stream: bool

    @property
    def kind(self) -> str:
        return ("chat" if "chat" in self.path else "completion") + (" (streamed)" if self.stream else "")


@dataclasses.dataclass
class Answer:
    ok: bool
    text: str
    token_ids: list[int] | None
    detail: str = ""


def requests(ctx: Context, n: int) -> list[Request]:
    """N conversations that differ in kind (completion, chat), streaming, prompt and length."""
    extra = {"ignore_eos": True} if ctx.ignore_eos else {}
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)] + (f", part {i // len(TOPICS) + 1}" if i >= len(TOPICS) else "")
        tokens = 24 + 8 * (i % 3)
        if i % 2 == 0:
            body = ctx.payload(f"A short note about {topic}:" + " and then" * (i % 5), tokens)
            path = "/v1/completions"
        else:
            body = {"model": ctx.model, "max_tokens": tokens, "temperature": 0, **extra,
                    "messages": [{"role": "user", "content": f"Tell me about {topic}."},
                                 {"role": "assistant", "content": "Gladly."},
                                 {"role": "user", "content": "Go on" + ", please" * (i % 4) + "."}]}
            path = "/v1/chat/completions"
        out.append(Request(i, path, body, stream=(i // 2) % 2 == 1))
    return out


def ask(ctx: Context, r: Request, timeout_s: float) -> Answer:
    if r.stream:
        s = ctx.client.stream(r.path, r.body, timeout_s=timeout_s)
        ok = s.status == 200 and s.done and not s.errors and s.transport_error is None
        return Answer(ok, s.text(), s.token_ids(), "" if ok else
                      f"stream answered {s.status}, done={s.done}, errors={s.errors[:1]}, transport={s.transport_error}")
    a = ctx.client.post(r.path, r.body, timeout_s=timeout_s)
    return Answer(a.ok, a.text(), a.token_ids(), "" if a.ok else f"answered {a.status}: {a.error_message()[:200]}")


def first_difference(solo: Answer, together: Answer) -> str | None:
    """Where the answer given beside the others first differs from the solo one, or None when they are equal."""
    if solo.token_ids is not None and together.token_ids is not None and solo.token_ids != together.token_ids:
        k = next((i for i, (a, b) in enumerate(zip(solo.token_ids, together.token_ids)) if a != b),
                 min(len(solo.token_ids), len(together.token_ids)))
        return (f"token {k} differs: solo {solo.token_ids[k:k + 4]} vs together {together.token_ids[k:k + 4]} "
                f"(of {len(solo.token_ids)} / {len(together.token_ids)} tokens)")
    if solo.text != together.text:
        k = next((i for i, (a, b) in enumerate(zip(solo.text, together.text)) if a != b),
                 min(len(solo.text), len(together.text)))
        return f"the text differs from character {k}: solo {solo.text[k:k + 40]!r} vs together {together.text[k:k + 40]!r}"
    return None


@case("concurrent_equals_solo", "N greedy conversations at once (N = the service's max_concurrency from /health) "
      "each answer token for token what the same request answers alone", group=F, timeout_s=_timeout,
      applicable=_applicable)
def concurrent_equals_solo(ctx: Context) -> Outcome:
    o = Outcome()
    served = served_concurrency(ctx)
    n = served["max_concurrency"]
    reqs = requests(ctx, n)
    each_s = _timeout(ctx) / 3
    o.metrics.update({"requests": n, "max_concurrency": n, "bound": served.get("bound")})
    solo = [ask(ctx, r, each_s) for r in reqs]
    for r, a in zip(reqs, solo):
        if not o.check(a.ok, f"request {r.index} ({r.kind}) alone: {a.detail}"):
            return o
    together: list[Answer | None] = [None] * n
    barrier = threading.Barrier(n)
    peak = {"slots_busy": None}
    stop = threading.Event()

    def one(r: Request) -> None:
        try:
            barrier.wait(30)
        except threading.BrokenBarrierError:
            pass
        together[r.index] = ask(ctx, r, each_s)

    def watch() -> None:  # how many the service had on its ranks at once, as its /health says
        while not stop.is_set():
            h = ctx.health(timeout_s=2)
            busy = h.body.get("slots_busy") if h.status == 200 and isinstance(h.body, dict) else None
            if isinstance(busy, int):
                peak["slots_busy"] = max(peak["slots_busy"] or 0, busy)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in reqs]
    t0 = time.monotonic()
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(each_s + 35)
    stop.set()
    watcher.join(5)
    o.metrics["together_wall_s"] = round(time.monotonic() - t0, 3)
    o.metrics["slots_busy_peak"] = peak["slots_busy"]
    differ = []
    for r, alone, now in zip(reqs, solo, together):
        if now is None:
            o.check(False, f"request {r.index} ({r.kind}) sent with the others did not end")
            continue
        if not o.check(now.ok, f"request {r.index} ({r.kind}) sent with the others: {now.detail}"):
            continue
        why = first_difference(alone, now)
        if why is not None:
            differ.append(r.index)
            if len(differ) == 1:  # the first differing request, in full
                o.check(False, f"request {r.index} ({r.kind}) answered differently with {n - 1} others than alone: "
                               f"{why}")
                o.note("request", f"request {r.index} ({r.kind}): {r.body}")
    if len(differ) > 1:
        o.check(False, f"{len(differ)} of {n} requests differ in all: {differ[:16]}")
    o.metrics["differing_requests"] = differ
    if peak["slots_busy"] is not None and peak["slots_busy"] < 2:
        o.warn(f"/health never showed two requests on the ranks at once (slots_busy peaked at {peak['slots_busy']}): "
               "the requests may not have overlapped, so the comparison says little about batching")
    return o
