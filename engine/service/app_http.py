"""HTTP plumbing shared by the routes: OpenAI-style error bodies, the API-key check, the
body-size limit, and the one structured log line per request.
"""

from __future__ import annotations

import hmac
import json
import time
import typing

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.service.proxy_log import StructuredLog
from engine.service.proxy_metrics import Metrics


class SafeJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error that quotes a client's lone
    surrogate (valid JSON, not encodable as UTF-8) still renders instead of failing with a 500."""

    def render(self, content: typing.Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ApiError(Exception):
    """An answer other than 200, raised anywhere in a route."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             413: "invalid_request_error", 422: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")


def error_body(status: int, message: str, param: str | None = None, kind: str = "server_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(exc: ApiError) -> JSONResponse:
    return SafeJSONResponse(error_body(exc.status, exc.message, exc.param, exc.kind), status_code=exc.status,
                        headers=exc.headers)


def key_matches(authorization: str | bytes | None, api_key: str) -> bool:
    """An 'Authorization: Bearer <key>' header value carries `api_key` (compared in constant time)."""
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    header = authorization or ""
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), api_key.encode())


def has_api_key(request: Request, api_key: str | None) -> bool:
    """True when no key is configured or the request carries 'Authorization: Bearer <key>'."""
    return api_key is None or key_matches(request.headers.get("authorization", ""), api_key)


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries 'Authorization: Bearer <key>'."""
    if not has_api_key(request, api_key):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


def route_label(scope) -> str:
    """The metric label of a request: the template of the route that answered it (a fixed
    set, whatever the client sent as a path), or "other" when no route matched."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "other"


class EdgeMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): refuses bodies over the
    limit with 413, counts responses by route template and status, and writes one log line per
    request with whatever the route put in request.state.log (job id, generation, PIDs...)."""

    def __init__(self, app, body_limit_bytes: int, log: StructuredLog, metrics: Metrics):
        self.app, self.limit, self.log, self.metrics = app, body_limit_bytes, log, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        path = scope.get("path", "")
        status_box: dict = {}
        scope.setdefault("state", {})

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status_box["status"] = message["status"]
            await send(message)

        try:
            headers = dict(scope.get("headers") or [])
            if b"transfer-encoding" in headers and b"content-length" in headers:
                # RFC 9112 6.1: a request with both is a smuggling attempt or a broken client.
                await self._refuse(send_wrapper, 400, "the request has both Content-Length and "
                                                      "Transfer-Encoding: send one of them")
                return
            declared = headers.get(b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.limit:
                await self._too_large(send_wrapper)
                return
            body, more = [], True
            size = 0
            while more and scope.get("method") in ("POST", "PUT", "PATCH"):
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limit:
                    await self._too_large(send_wrapper)
                    return
                body.append(chunk)
                more = message.get("more_body", False)
            replay = [{"type": "http.request", "body": b"".join(body), "more_body": False}]

            async def replay_receive():
                return replay.pop() if replay else await receive()

            await self.app(scope, replay_receive, send_wrapper)
        finally:
            status = status_box.get("status")
            self.metrics.inc("v100plan_requests_total", endpoint=route_label(scope), status=str(status or "none"))
            if path.startswith("/v1/"):
                self._log_request(scope, path, status, t0)

    def _log_request(self, scope, path: str, status: int | None, t0: float) -> None:
        fields = dict(scope["state"].get("log") or {})
        job = scope["state"].get("job")

        def emit(_event=None):
            extra = job.log_fields() if job is not None else {}
            self.log.emit("request", method=scope.get("method"), path=path, status=status,
                          duration_ms=round((time.monotonic() - t0) * 1000, 1), **fields, **extra)

        if job is not None and job.state != "finished":
            # The client left before the ranks finished (they are cancelling): log once both
            # ranks said how they ended, so the line shows that both stopped.
            job.on_finish = emit
        else:
            emit()

    async def _refuse(self, send, status: int, message: str) -> None:
        resp = SafeJSONResponse(error_body(status, message, None, "invalid_request_error"), status_code=status,
                                headers={"connection": "close"})
        await resp({"type": "http"}, None, send)

    async def _too_large(self, send) -> None:
        resp = SafeJSONResponse(error_body(413, f"request body over the limit of {self.limit} bytes", None,
                                       "invalid_request_error"), status_code=413)
        await resp({"type": "http"}, None, send)


# ----- the connection layer (uvicorn's h11 protocol with limits) ------------------------------


def guarded_h11_protocol(max_connections: int, header_timeout_s: float, body_timeout_s: float,
                         metrics: Metrics | None = None, log: StructuredLog | None = None,
                         api_key: str | None = None):
    """uvicorn's h11 protocol class with what a reverse proxy would add in front of it:

    - a connection cap that keyless clients cannot use against key holders: one connection more than
      `max_connections` closes an idle connection that never showed the API key (the oldest of the
      client address holding most such; on a keyed service a keyless request in progress counts as
      idle: it can only be refused), counted in v100plan_connections_evicted_total. A connection
      shows the key with its request headers (a constant-time comparison, before any body is read),
      and from then on is never closed for room. Only when nothing can be closed is the new one
      answered 503 with Retry-After and closed at once (descriptors are never exhausted), counted in
      v100plan_connections_refused_total and logged (one line a second at most, with the count);
    - a body cut short: a client that half-closes before its Content-Length arrived (or in the middle
      of its headers) is answered 400, not silence;
    - a request h11 cannot parse (bad chunk size, negative Content-Length, obs-fold, no Host) is
      answered with the documented JSON 400, not uvicorn's plain text;
    - read timeouts: a request's headers must arrive within `header_timeout_s` of the
      connection opening (or of its first byte after a keep-alive pause), its body within
      `body_timeout_s` of the headers; otherwise 408 and close. Idle kept-alive connections
      are closed by uvicorn's own keep-alive timeout.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def _canned(status: int, reason: str, message: str, extra: str = "") -> bytes:
        body = json.dumps(error_body(status, message, None, "service_unavailable" if status == 503
                                     else "invalid_request_error")).encode()
        return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"{extra}content-length: {len(body)}\r\n\r\n").encode() + body

    busy = _canned(503, "Service Unavailable", f"too many open connections (the cap is {max_connections}); "
                                               "retry shortly", extra="retry-after: 1\r\n")
    malformed = _canned(400, "Bad Request", "the request is not valid HTTP/1.1 (its framing, Content-Length, "
                                            "chunk sizes, header lines or Host header)")
    truncated = _canned(400, "Bad Request", "the client closed its side before the request was complete (its "
                                            "headers, or a body shorter than its Content-Length)")
    refused = {"count": 0, "logged": 0.0}

    def _refused() -> None:
        if metrics is not None:
            metrics.inc("v100plan_connections_refused_total")
        refused["count"] += 1
        now = time.monotonic()
        if log is not None and now - refused["logged"] >= 1.0:
            log.emit("connections_refused", count=refused["count"], max_connections=max_connections)
            refused["count"], refused["logged"] = 0, now

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._phase: str | None = None
            self._phase_timer = None
            self._keyed = False          # a request of this connection showed the API key
            self._seen_cycle = None
            self._opened = time.monotonic()
            if len(self.connections) > max_connections and not self._make_room():
                transport.write(busy)
                transport.close()
                _refused()
                return
            self._enter("headers")

        def _evictable(self) -> bool:
            if self._keyed or self.transport is None or self.transport.is_closing():
                return False
            if self.cycle is None or self.cycle.response_complete:
                return True  # between requests, or none yet (headers still coming in)
            return api_key is not None and not self.cycle.response_started  # keyless on a keyed service

        def _make_room(self) -> bool:
            """Close one idle keyless connection, the oldest of the address that holds most: True if one was."""
            by_client: dict[str, list] = {}
            for conn in self.connections:
                if conn is not self and isinstance(conn, GuardedH11Protocol) and conn._evictable():
                    by_client.setdefault((conn.client or ("",))[0], []).append(conn)
            if not by_client:
                return False
            heaviest = max(by_client.values(), key=len)
            min(heaviest, key=lambda c: c._opened).transport.close()
            if metrics is not None:
                metrics.inc("v100plan_connections_evicted_total")
            return True

        def eof_received(self):
            state = self.conn.their_state
            if state is h11.SEND_BODY or (state is h11.IDLE and self.conn.trailing_data[0]):
                if self.cycle is None or not self.cycle.response_started:
                    self.transport.write(truncated)
            # A FIN after a whole request reads the same as a client gone (it closed, or half-closed): the
            # transport closes and the app sees the disconnect, which cancels the request on both ranks.
            return False

        def _enter(self, phase: str | None) -> None:
            if phase == self._phase:
                return
            self._phase = phase
            if self._phase_timer is not None:
                self._phase_timer.cancel()
                self._phase_timer = None
            if phase is not None:
                limit = header_timeout_s if phase == "headers" else body_timeout_s
                self._phase_timer = self.loop.call_later(limit, self._read_timed_out, phase, limit)

        def _read_timed_out(self, phase: str, limit: float) -> None:
            self._phase_timer = None
            if self._phase != phase or self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:  # nothing said yet on this request
                self.transport.write(_canned(408, "Request Timeout",
                                             f"the request {phase} did not arrive within {limit:g} s"))
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._phase is None and self.conn.their_state is h11.IDLE:
                self._enter("headers")  # the next request on a kept-alive connection begins
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._seen_cycle:  # a new request's headers
                self._seen_cycle = self.cycle
                if api_key is not None and not self._keyed:
                    self._keyed = key_matches(dict(self.cycle.scope["headers"]).get(b"authorization"), api_key)
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._enter("body")
            elif state is not h11.IDLE:
                self._enter(None)  # the request is complete: the app's time is not a read timeout

        def send_400_response(self, msg: str) -> None:
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(malformed)
            self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE:
                self._enter(None)  # between requests: uvicorn's keep-alive timeout applies

        def connection_lost(self, exc) -> None:
            self._enter(None)
            super().connection_lost(exc)

    return GuardedH11Protocol


class RateLimitFilter:
    """A logging filter that lets each distinct message through once per `period_s` and says how
    many were held back (a flood such as "Too many open files" on every accept cannot fill a disk)."""

    def __init__(self, period_s: float = 10.0):
        self.period_s = period_s
        self._last: dict[tuple, list] = {}

    def filter(self, record) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.period_s:
            seen[1] += 1
            return False
        held = seen[1] if seen is not None else 0
        self._last[key] = [now, 0]
        if len(self._last) > 1000:
            self._last.clear()
        if held:
            record.msg = f"{record.msg} [{held} more like this in the last {self.period_s:g} s not shown]"
        return True
