"""The OpenAI-compatible API over the two ranks: routes, validation, streaming, disconnects.

/v1/completions and /v1/chat/completions (SSE streaming and not), /v1/models,
/health (200 only while both ranks are up with a passed self-test; its details need
the API key when one is set), /metrics (Prometheus text; the key when one is set),
/openapi.json (the request schemas, as vLLM serves them), and /control/* when fault
injection is enabled (control.py).

Every input ends in a JSON answer: 4xx naming the field for anything a client can get
wrong, never a traceback; error bodies are ASCII-escaped JSON, so even a lone surrogate
quoted back renders. Streams send one event per generated token as soon as both ranks
agreed on it (text deltas with a tokenizer, always with the token id).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.service import images, watchdog
from engine.service.app_http import (
    ApiError,
    EdgeMiddleware,
    SafeJSONResponse,
    check_api_key,
    error_body,
    error_response,
    has_api_key,
)
from engine.service.app_schemas import GREEDY_BELOW, SEED_MAX, ChatRequest, CompletionRequest
from engine.service.proxy_jobs import GenerateParams, Job
from engine.service.proxy_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.service.proxy_service import QueueFull, Service, Unavailable
from engine.service.proxy_text import ModelText, TextAssembler
from engine.service.serve_config import service_limits

# OpenAI's documented default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


def create_app(service: Service, text: ModelText) -> FastAPI:
    cfg = service.cfg
    pictures = images.ProxyImages.from_serve(cfg, text)  # image_url parts (engine.service.images)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await service.stop()

    app = FastAPI(title="v100plan engine", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", default_response_class=SafeJSONResponse)
    app.add_middleware(EdgeMiddleware, body_limit_bytes=cfg.body_limit_bytes, log=service.log,
                       metrics=service.metrics)
    app.add_exception_handler(ApiError, lambda request, exc: error_response(exc))
    app.add_exception_handler(images.ImageRefused, lambda request, exc: error_response(ApiError(400, exc.message,
                                                                                                exc.param)))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected(service))

    @app.get("/health")
    async def health(request: Request):
        pair = service.pair
        if pair is not None and service.state == "up" and pair.failure is None:
            # Judge now, not at the watchdog's next tick: a rank found dead turns this 503 at once.
            failure = watchdog.pair_failure(pair, service._busy_since(), cfg.stall_timeout_s,
                                            liveness_timeout_s=cfg.liveness_timeout_s or None)
            if failure is not None:
                pair.fail(failure)
        up = service.state == "up" and pair is not None and pair.failure is None
        status = "ok" if up else service.state
        if not has_api_key(request, cfg.api_key):
            return SafeJSONResponse({"status": status}, status_code=200 if up else 503)  # no details without the key
        body = {"status": status, "state": service.state, "generation": service.generation,
                "rank_pids": pair.pids if pair else [], "allreduce": pair.allreduce if pair else None,
                "selftest": "passed" if up else None, "last_failure": service.last_failure,
                "last_cause": service.last_cause.value if service.last_cause else None,
                "previous_exit": service.previous_exit, "limits": service_limits(cfg),
                "max_heartbeat_gap_s": [round(link.max_heartbeat_gap_s, 3) for link in pair.links] if pair else None,
                "decode": service.decode.health() if pair else None,
                "speculation": service.decode.speculation(cfg.draft_tokens), **pictures.health()}
        return SafeJSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        check_api_key(request, cfg.api_key)
        return PlainTextResponse(service.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, cfg.api_key)
        return {"object": "list", "data": [_model_card(text, _context_limit())]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        check_api_key(request, cfg.api_key)
        _check_model(model_id, text)
        return _model_card(text, _context_limit())

    def _context_limit() -> int | None:
        return (service.pair.max_context if service.pair else None) or cfg.max_context

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_api_key(request, cfg.api_key)
        _check_common(body, text)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            prompt_ids = _encode(text, prompt)
        else:
            bad = [t for t in prompt if not 0 <= t < text.vocab_size]
            if bad or not prompt:
                raise ApiError(400, f"prompt token ids must be in [0, {text.vocab_size}) and not empty"
                                    + (f"; got {bad[:5]}" if bad else ""), "prompt")
            prompt_ids = list(prompt)
        return await _serve(request, body, prompt_ids, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                            "completion")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_api_key(request, cfg.api_key)
        _check_common(body, text)
        pics = await pictures.load(body.messages)  # every limit answered 400 (images.ImageRefused)
        for i, m in enumerate(body.messages):
            if m.media() and not pictures.serves(m.media()):
                raise ApiError(400, f"messages.{i}.content: {m.media()[0]} input is not served: this engine runs the "
                                    f"model's text decoder only (a multimodal checkpoint's vision weights are not "
                                    f"loaded); send text parts", f"messages.{i}.content")
            _check_text(m.text(), f"messages.{i}.content")
        try:
            prompt_text = text.render_chat([(m.role, pictures.text(m)) for m in body.messages])
        except ValueError as exc:
            raise ApiError(400, f"cannot build a chat prompt for this model: {exc}", "messages") from None
        prompt_ids = pictures.expand(_encode(text, prompt_text, "messages"), pics)
        return await _serve(request, body, prompt_ids, body.requested_max_tokens(), "chat", pics)

    async def _serve(request: Request, body, prompt_ids: list[int], max_tokens: int | None, kind: str, pics=()):
        field = "messages" if kind == "chat" else "prompt"
        if not prompt_ids:
            raise ApiError(400, f"{field}: the prompt is empty (it encodes to no tokens)", field)
        limit = (service.pair.max_context if service.pair else None) or cfg.max_context
        if limit is not None:
            if len(prompt_ids) >= limit:
                raise ApiError(400, f"{field}: the prompt is {len(prompt_ids)} tokens; the context limit of {limit} "
                                    f"tokens leaves no room for a completion", field)
            if max_tokens is None:
                max_tokens = limit - len(prompt_ids)
            if len(prompt_ids) + max_tokens > limit:
                raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = "
                                    f"{len(prompt_ids) + max_tokens} exceeds the context limit of {limit} tokens",
                               "max_tokens")
        seed = body.seed if body.seed is not None else secrets.randbelow(SEED_MAX)
        eos_ids = () if body.ignore_eos else text.eos_token_ids
        # As vLLM: a temperature below GREEDY_BELOW is greedy (dividing by it overflows float32).
        temperature = 0.0 if body.temperature < GREEDY_BELOW else body.temperature
        params = GenerateParams(prompt_ids=tuple(prompt_ids), max_tokens=max_tokens or 1,
                                temperature=temperature, top_p=body.top_p, seed=seed,
                                stop_token_ids=eos_ids, images=tuple(images.wire(pics)))
        try:
            job = service.submit(params, kind)
        except (Unavailable, QueueFull) as exc:
            status = 503 if isinstance(exc, Unavailable) else 429
            raise ApiError(status, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
        request.state.job = job
        request.state.log = {"kind": kind, "stream": body.stream, "seed": seed,
                             "prompt_tokens": len(prompt_ids), "max_tokens": params.max_tokens}
        assembler = TextAssembler(text, body.stop_strings(), eos_ids)
        created = int(time.time())
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if body.stream:
            return StreamingResponse(_stream(request, job, assembler, kind, rid, created),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _complete(request, job, assembler, kind, rid, created)

    async def _complete(request: Request, job: Job, assembler: TextAssembler, kind: str, rid: str, created: int):
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            while True:
                getter = asyncio.ensure_future(job.events.get())
                await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    service.withdraw(job)  # the client is gone: stop both ranks
                    _log(request, job, "client_gone")
                    return SafeJSONResponse(error_body(499, "client closed the request"), status_code=499)
                event = getter.result()
                if event[0] == "token":
                    assembler.add(event[1])
                    if assembler.stopped:
                        job.cancel("stop")
                elif event[0] == "error":
                    _log(request, job, "error", error=event[2])
                    return SafeJSONResponse(error_body(event[1], event[2], None, "service_unavailable"
                                                   if event[1] == 503 else "server_error"),
                                        status_code=event[1], headers={"Retry-After": "5"} if event[1] == 503 else None)
                elif event[0] == "done":
                    assembler.flush()
                    reason = _finish_reason(event[1], job, assembler)
                    _log(request, job, reason, usage=event[2])
                    return _full_body(kind, rid, created, text.model_id, assembler, reason, event[2], job)
        finally:
            gone.cancel()

    async def _stream(request: Request, job: Job, assembler: TextAssembler, kind: str, rid: str, created: int):
        finished = False
        try:
            if kind == "chat":
                yield _sse(_chunk(kind, rid, created, text.model_id, None, None, role=True))
            while True:
                event = await job.events.get()
                if event[0] == "token":
                    after_stop = assembler.stopped
                    delta = assembler.add(event[1])
                    if assembler.stopped:
                        job.cancel("stop")
                    if not after_stop:  # one event per token, as soon as both ranks agreed on it
                        chunk = _chunk(kind, rid, created, text.model_id, delta, None)
                        chunk["v100plan"] = {"token_ids": [event[1]]}
                        yield _sse(chunk)
                elif event[0] == "error":
                    finished = True
                    _log(request, job, "error", error=event[2])
                    yield _sse(error_body(event[1], event[2], None,
                                          "service_unavailable" if event[1] == 503 else "server_error"))
                    yield "data: [DONE]\n\n"
                    return
                elif event[0] == "done":
                    finished = True
                    delta = assembler.flush()
                    reason = _finish_reason(event[1], job, assembler)
                    _log(request, job, reason, usage=event[2])
                    if delta:
                        yield _sse(_chunk(kind, rid, created, text.model_id, delta, None))
                    last = _chunk(kind, rid, created, text.model_id, None, reason)
                    last["usage"] = _usage(event[2])
                    last["v100plan"] = _extension(job, assembler)
                    yield _sse(last)
                    yield "data: [DONE]\n\n"
                    return
        finally:
            if not finished:  # the client went away mid-stream (the generator was closed)
                service.withdraw(job)
                _log(request, job, "client_gone")

    return app


# ----- helpers -----------------------------------------------------------------------------


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Routing and framework refusals (404 unknown path, 405 wrong method, 400 unreadable body)
    in the same OpenAI error shape as everything else."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
    message = {404: "no such route", 405: "method not allowed on this route"}.get(exc.status_code, str(exc.detail))
    return SafeJSONResponse(error_body(exc.status_code, message, None, kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


def _unexpected(service: Service):
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: logged in full, answered without internals.
        service.log.emit("unexpected_error", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
        return SafeJSONResponse(error_body(500, "internal error (see the service log)"), status_code=500)

    return handler


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return SafeJSONResponse(error_body(400, f"the body is not valid JSON: {first.get('msg')}", None,
                                       "invalid_request_error"), status_code=400)
    message = f"{param or 'body'}: {first.get('msg', 'invalid')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return SafeJSONResponse(error_body(422, message, param, "invalid_request_error"), status_code=422)


def _check_model(name: str, text: ModelText) -> None:
    if name != text.model_id:
        raise ApiError(404, f"model {name!r} is not served here; this service serves {text.model_id!r}", "model",
                       "not_found_error")


def _check_common(body, text: ModelText) -> None:
    _check_model(body.model, text)
    problem = body.unsupported()
    if problem is not None:
        raise ApiError(400, f"{problem[0]}: {problem[1]}", problem[0])
    for stop in body.stop_strings():
        _check_text(stop, "stop")


def _check_text(value: str, field: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800") that no tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{field}: contains a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X}) "
                            f"at character {exc.start}; send valid Unicode text", field) from None


def _encode(text: ModelText, prompt: str, field: str = "prompt") -> list[int]:
    try:
        return text.encode_prompt(prompt)
    except ValueError as exc:
        raise ApiError(400, f"{field}: {exc}", field) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _finish_reason(rank_reason: str, job: Job, assembler: TextAssembler) -> str:
    if assembler.stopped or job.cancel_reason == "stop":
        return "stop"
    return rank_reason


def _log(request: Request, job: Job, outcome: str, **extra) -> None:
    fields = dict(getattr(request.state, "log", {}) or {})
    fields.update(outcome=outcome, **extra)
    request.state.log = fields


def _usage(usage: dict) -> dict:
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens") or 0)}}


def _extension(job: Job, assembler: TextAssembler) -> dict:
    """Beyond OpenAI's schema: what the acceptance suite needs to check an answer exactly."""
    return {"token_ids": list(assembler.ids), "seed": job.params.seed, "generation": job.generation}


def _model_card(text: ModelText, max_model_len: int | None) -> dict:
    # max_model_len as vLLM names it: clients (the acceptance suite among them) learn the context limit.
    return {"id": text.model_id, "object": "model", "created": 0, "owned_by": "v100plan",
            "max_model_len": max_model_len}


def _full_body(kind, rid, created, model_id, assembler: TextAssembler, reason, usage, job) -> dict:
    content = assembler.emitted
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                  "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": content, "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model_id, "choices": [choice],
            "usage": _usage(usage), "v100plan": _extension(job, assembler)}


def _chunk(kind, rid, created, model_id, delta: str | None, reason: str | None, role: bool = False) -> dict:
    if kind == "chat":
        d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
        choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model_id, "choices": [choice]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
