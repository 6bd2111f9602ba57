"""One stream's decode speed of any OpenAI-compatible server, at several contexts, prefill subtracted.

At each prompt size P the same prompt is sent with two generation lengths, short S and long L
(`/v1/completions`, temperature 0, `ignore_eos` where the server takes it), ``repeats`` times each:

  ms per token = (fastest time of L - fastest time of S) / (tokens L - tokens S)

so prefill, the first token and the HTTP round trip cancel out (as `engine.bench.served` measures the
bundled engine, which takes medians: the fastest of the repeats is taken here because what else runs on a
shared host only ever adds time); the tokens are the server's own count (`usage.completion_tokens`), so a request that
stopped early is counted as what it generated. That figure is the mean decode step over contexts
P + S .. P + L: the point's context is P + (S + L) / 2, with P the server's `usage.prompt_tokens`.

Prompt sizes reach up to the server's limit (`max_model_len` in /v1/models, as vLLM and the bundled
engine publish it; else the sizes asked for). No clocks but the monotonic one; no I/O but the HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from v100plan.accept.http import Client
from v100plan.errors import BadInput, EnvironmentProblem

PROMPT_WORD = " the"          # one token in every common tokenizer; the server counts them (usage.prompt_tokens)


@dataclass(frozen=True)
class Point:
    prompt_tokens: int
    short_tokens: int
    long_tokens: int
    short_s: list[float]
    long_s: list[float]

    @property
    def ms_per_token(self) -> float:
        return (min(self.long_s) - min(self.short_s)) * 1e3 / (self.long_tokens - self.short_tokens)

    @property
    def context_tokens(self) -> int:
        """The mean context of the decode steps the figure covers."""
        return self.prompt_tokens + (self.short_tokens + self.long_tokens) // 2

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "context_tokens": self.context_tokens,
                "short_tokens": self.short_tokens, "long_tokens": self.long_tokens,
                "short_s": [round(t, 5) for t in self.short_s], "long_s": [round(t, 5) for t in self.long_s],
                "ms_per_token": round(self.ms_per_token, 4)}


@dataclass
class Measurement:
    endpoint: str
    model: str
    max_model_len: int | None
    ignore_eos: bool
    points: list[Point] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)     # prompt sizes the server refused as too long, with its words


class TooLong(EnvironmentProblem):
    """The server refused a prompt as longer than its context (a 400 that names the context or the length)."""


def _models(client: Client) -> tuple[str, int | None]:
    a = client.request("GET", "/v1/models")
    if a.status is None:
        raise EnvironmentProblem(f"no answer from {client.base_url}: {a.error}",
                                 hint="start the server, or give the URL it listens on (http://HOST:PORT)")
    if a.status in (401, 403):
        raise BadInput(f"{client.base_url} refused /v1/models ({a.status})", hint="give --api-key-file with the server's key")
    data = (a.body or {}).get("data") if isinstance(a.body, dict) else None
    if a.status != 200 or not data:
        raise EnvironmentProblem(f"{client.base_url}/v1/models answered {a.status}, not a model list",
                                 hint="the endpoint must be an OpenAI-compatible server (the base URL, without /v1)")
    card = data[0]
    limit = card.get("max_model_len")
    return str(card["id"]), int(limit) if isinstance(limit, int) else None


def _complete(client: Client, model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> tuple[float, int, int]:
    """(seconds, completion tokens, prompt tokens) of one non-streamed completion."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.monotonic()
    a = client.request("POST", "/v1/completions", json_body=body)
    dt = time.monotonic() - t0
    if a.status == 400 and any(w in a.error_message().lower() for w in ("context", "too long", "maximum", "length")):
        raise TooLong(a.error_message()[:200])
    if not a.ok:
        raise EnvironmentProblem(f"/v1/completions ({len(prompt.split())}-word prompt, max_tokens {max_tokens}) answered "
                                 f"{a.status}: {a.error_message()[:200]}", hint="check the server's log")
    usage = a.body.get("usage") or {}
    done = usage.get("completion_tokens")
    prompt_tokens = usage.get("prompt_tokens")
    if not isinstance(done, int) or not isinstance(prompt_tokens, int):
        raise EnvironmentProblem("the server's completion has no usage.completion_tokens / prompt_tokens",
                                 hint="calibrate counts the server's own tokens; this server does not report them")
    return dt, done, prompt_tokens


def _takes_ignore_eos(client: Client, model: str) -> bool:
    """Whether the server accepts vLLM's `ignore_eos` (OpenAI's API has no such field; some servers refuse it)."""
    a = client.request("POST", "/v1/completions", json_body={"model": model, "prompt": PROMPT_WORD, "max_tokens": 1,
                                                             "temperature": 0, "ignore_eos": True})
    return a.ok


def _warm_up(client: Client, model: str, eos: bool, wait_s: float = 120.0) -> float:
    """One short request, the first paying the start-up costs; a server still starting (503) is waited for.
    Returns the server's tokens per prompt word (its usage.prompt_tokens of an 8-word prompt, less one for a
    BOS token), which sizes the prompts."""
    deadline = time.monotonic() + wait_s
    while True:
        body = {"model": model, "prompt": PROMPT_WORD * 8, "max_tokens": 2, "temperature": 0}
        a = client.request("POST", "/v1/completions", json_body={**body, **({"ignore_eos": True} if eos else {})})
        if a.ok or a.status != 503 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if not a.ok:
        raise EnvironmentProblem(f"/v1/completions answered {a.status}: {a.error_message()[:200]}",
                                 hint="check the server's log (still starting after 120 s, or refusing completions)")
    used = (a.body.get("usage") or {}).get("prompt_tokens")
    return max((used - 1) / 8, 1.0) if isinstance(used, int) and used > 1 else 1.0


def measure(client: Client, prompt_sizes: list[int], short: int, long: int, repeats: int) -> Measurement:
    """Every point (module docstring); sizes past the server's limit (prompt + long) are left out."""
    if not 0 < short < long:
        raise BadInput(f"the generation lengths must satisfy 0 < short < long, got {short} and {long}",
                       hint="e.g. --short 16 --long 64")
    model, limit = _models(client)
    per_word = _warm_up(client, model, False)
    eos = _takes_ignore_eos(client, model)
    m = Measurement(client.base_url, model, limit, eos)
    sizes = [p for p in prompt_sizes if limit is None or p + long + 8 <= limit]
    if limit is not None and len(sizes) < len(prompt_sizes):
        top = max(limit - long - 8, 1)
        sizes = sorted(set(sizes + [top]))
    prompts = {size: PROMPT_WORD * max(round(size / per_word), 1) for size in sizes}
    runs: dict[int, dict[int, list[tuple[float, int, int]]]] = {size: {short: [], long: []} for size in sizes}
    # Round-robin over the sizes, repeat after repeat: a load that comes and goes on the host then slows every
    # size alike instead of one of them.
    for _ in range(repeats):
        for size in list(runs):
            try:
                for n in (short, long):
                    runs[size][n].append(_complete(client, model, prompts[size], n, eos))
            except TooLong as e:
                m.skipped.append(f"{size} tokens: {e}")
                del runs[size]
    for size, r in runs.items():
        n_short = min(x[1] for x in r[short])
        n_long = min(x[1] for x in r[long])
        if n_long <= n_short:
            raise EnvironmentProblem(f"at a {size}-token prompt the server generated {n_long} tokens when asked for {long} "
                                     f"and {n_short} for {short}: the model stops early and the server takes no ignore_eos",
                                     hint="serve a model that does not stop at once, or a server that accepts ignore_eos")
        m.points.append(Point(r[short][0][2], n_short, n_long, [x[0] for x in r[short]], [x[0] for x in r[long]]))
    return m
