"""The suite's HTTP client: one httpx client per target, streaming read event by event.

Every call is bounded by a timeout; transport failures come back as values (status None and
the error text), because for a fault case "the connection broke" is an observation, not a crash.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx


@dataclass
class Answer:
    """One non-streamed request's outcome."""

    status: int | None                    # None: no HTTP answer (connection refused, reset, timeout)
    body: Any = None                      # parsed JSON, or the raw text when it is not JSON
    headers: dict[str, str] = field(default_factory=dict)
    error: str | None = None              # transport error text when status is None
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and isinstance(self.body, dict)

    def text(self) -> str:
        """The generated text of a completion or chat completion."""
        choice = (self.body or {}).get("choices", [{}])[0] if isinstance(self.body, dict) else {}
        if "message" in choice:
            return choice["message"].get("content") or ""
        return choice.get("text") or ""

    def finish_reason(self) -> str | None:
        if not isinstance(self.body, dict):
            return None
        return (self.body.get("choices") or [{}])[0].get("finish_reason")

    def token_ids(self) -> list[int] | None:
        """The bundled engine's exact token ids (its `v100plan` extension), else None."""
        ext = self.body.get("v100plan") if isinstance(self.body, dict) else None
        return list(ext["token_ids"]) if isinstance(ext, dict) and "token_ids" in ext else None

    def error_message(self) -> str:
        if isinstance(self.body, dict) and isinstance(self.body.get("error"), dict):
            return str(self.body["error"].get("message", ""))
        return self.error or (self.body if isinstance(self.body, str) else "")[:300]


@dataclass
class Stream:
    """One streamed request: every SSE data event with its arrival time (seconds after the send)."""

    status: int | None
    events: list[tuple[float, dict]] = field(default_factory=list)
    done: bool = False                    # saw data: [DONE]
    errors: list[dict] = field(default_factory=list)  # error events inside the stream
    cut: bool = False                     # the connection ended without [DONE]
    cut_by_client: bool = False           # we stopped reading on purpose
    transport_error: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None                      # the JSON body when the answer was not a stream (an error)
    t_end_s: float = 0.0
    t_sent: float = 0.0                   # time.monotonic() when the request was sent
    first_error_s: float | None = None    # seconds after the send of the first error event

    def text(self) -> str:
        out = []
        for _, ev in self.events:
            choice = (ev.get("choices") or [{}])[0]
            delta = choice.get("delta")
            out.append((delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or ""))
        return "".join(out)

    def token_events(self) -> list[tuple[float, dict]]:
        """Events that carry generated text (or, in the engine's extension, token ids)."""
        out = []
        for t, ev in self.events:
            choice = (ev.get("choices") or [{}])[0]
            delta = choice.get("delta")
            piece = (delta.get("content") if isinstance(delta, dict) else choice.get("text")) or ""
            if piece or (ev.get("v100plan") or {}).get("token_ids"):
                out.append((t, ev))
        return out

    def finish_reason(self) -> str | None:
        for _, ev in reversed(self.events):
            reason = (ev.get("choices") or [{}])[0].get("finish_reason")
            if reason:
                return reason
        return None

    def token_ids(self) -> list[int] | None:
        for _, ev in reversed(self.events):
            ext = ev.get("v100plan")
            if isinstance(ext, dict) and "token_ids" in ext:
                return list(ext["token_ids"])
        return None


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=self.auth_headers(api_key))

    @staticmethod
    def auth_headers(api_key: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, *, json_body: Any = None, content: bytes | str | None = None,
                headers: dict[str, str] | None = None, timeout_s: float | None = None,
                auth: bool = True) -> Answer:
        hdrs = dict(headers or {})
        if not auth:
            hdrs["Authorization"] = ""
        t0 = time.monotonic()
        try:
            kw: dict[str, Any] = {"headers": hdrs, "timeout": timeout_s or self.timeout_s}
            if content is not None:
                kw["content"] = content
            elif json_body is not None:
                kw["json"] = json_body
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            return Answer(None, error=f"{type(exc).__name__}: {exc}", elapsed_s=time.monotonic() - t0)
        try:
            body: Any = r.json()
        except ValueError:
            body = r.text
        return Answer(r.status_code, body, dict(r.headers), elapsed_s=time.monotonic() - t0)

    def post(self, path: str, payload: dict, **kw) -> Answer:
        return self.request("POST", path, json_body=payload, **kw)

    def get(self, path: str, **kw) -> Answer:
        return self.request("GET", path, **kw)

    def stream(self, path: str, payload: dict, *, on_event: Callable[[int, dict], bool | None] | None = None,
               timeout_s: float | None = None) -> Stream:
        """POST with stream=true; `on_event(n, event)` may return True to hang up after event n."""
        t0 = time.monotonic()
        out = Stream(status=None, t_sent=t0)
        try:
            with self.http.stream("POST", path, json={**payload, "stream": True},
                                  timeout=timeout_s or self.timeout_s) as r:
                out.status = r.status_code
                out.headers = dict(r.headers)
                if r.status_code != 200 or "text/event-stream" not in r.headers.get("content-type", ""):
                    raw = r.read()
                    try:
                        out.body = json.loads(raw)
                    except ValueError:
                        out.body = raw.decode(errors="replace")
                    out.t_end_s = time.monotonic() - t0
                    return out
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        out.done = True
                        break
                    try:
                        ev = json.loads(data)
                    except ValueError:
                        continue
                    if "error" in ev:
                        if out.first_error_s is None:
                            out.first_error_s = time.monotonic() - t0
                        out.errors.append(ev["error"] if isinstance(ev["error"], dict) else {"message": str(ev)})
                        continue
                    out.events.append((time.monotonic() - t0, ev))
                    if on_event is not None and on_event(len(out.events), ev):
                        out.cut_by_client = True
                        break
        except httpx.HTTPError as exc:
            out.transport_error = f"{type(exc).__name__}: {exc}"
        out.cut = not out.done and not out.cut_by_client
        out.t_end_s = time.monotonic() - t0
        return out
