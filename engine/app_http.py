"""HTTP plumbing shared by the routes: OpenAI-style error bodies, the API-key check, the
body-size limit, and the one structured log line per request.
"""

from __future__ import annotations

import hmac
import time

from fastapi import Request
from fastapi.responses import JSONResponse

from engine.proxy_log import StructuredLog
from engine.proxy_metrics import Metrics

# Metric labels name these paths; anything else counts as "other" (bounded label values).
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")


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
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.kind), status_code=exc.status,
                        headers=exc.headers)


def check_api_key(request: Request, api_key: str | None) -> None:
    """401 unless the request carries 'Authorization: Bearer <key>' (compared in constant time)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), api_key.encode()):
        raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


class EdgeMiddleware:
    """Pure ASGI (streaming and disconnects pass through untouched): refuses bodies over the
    limit with 413, counts responses by endpoint and status, and writes one log line per
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
            declared = dict(scope.get("headers") or []).get(b"content-length")
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
            if path.startswith("/v1/"):
                endpoint = path if path in _ENDPOINTS or path.startswith("/v1/models/") else "other"
                self.metrics.inc("v100plan_requests_total", endpoint=endpoint, status=str(status or "none"))
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

    async def _too_large(self, send) -> None:
        resp = JSONResponse(error_body(413, f"request body over the limit of {self.limit} bytes", None,
                                       "invalid_request_error"), status_code=413)
        await resp({"type": "http"}, None, send)
