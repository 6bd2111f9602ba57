"""The OpenAI-compatible API over the two ranks: routes, validation, streaming, disconnects.

/v1/completions and /v1/chat/completions (SSE streaming and not), /v1/models,
/health (200 only while both ranks are up with a passed self-test; its details need
the API key when one is set), /metrics (Prometheus text; the key when one is set),
/openapi.json (the request schemas, as vLLM serves them; the key when one is set), and /control/* when fault
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

from engine.service import app_openapi, images, watchdog
from engine.service.app_answer import Answer, usage_body
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
from engine.service.chat_output import ChatOutput, prompt_opens_reasoning
from engine.service.constrained import tool_plan
from engine.service.proxy_jobs import GenerateParams, Job
from engine.service.proxy_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.service.proxy_service import QueueFull, Service, Unavailable
from engine.service.proxy_text import ModelText, TextAssembler, reasoning_parser
from engine.service.proxy_text_pool import ClientBusy, TextFailed, TextPool
from engine.service.serve_config import service_limits

# OpenAI's documented default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


def create_app(service: Service, text: ModelText, pool: TextPool | None = None) -> FastAPI:
    cfg = service.cfg
    pool = pool or TextPool(cfg.model_dir, cfg.served_model_name, cfg.text_workers, cfg.text_jobs_per_client,
                           cfg.chat_template, concurrency=lambda: service.max_concurrency)
    pictures = images.ProxyImages.from_serve(cfg, text)  # image_url parts (engine.service.images)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        warm = asyncio.get_running_loop().create_task(pool.start())  # while the ranks start
        try:
            yield
        finally:
            warm.cancel()
            pool.close()
            await service.stop()

    # No /docs or /redoc; /openapi.json is a route of ours below, so that it needs the key when one is set.
    app = FastAPI(title="v100plan engine", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, default_response_class=SafeJSONResponse)
    app.add_middleware(EdgeMiddleware, body_limit_bytes=cfg.body_limit_bytes, log=service.log,
                       metrics=service.metrics)
    app.add_exception_handler(ApiError, lambda request, exc: error_response(exc))
    app.add_exception_handler(images.ImageRefused, lambda request, exc: error_response(ApiError(400, exc.message,
                                                                                                exc.param)))
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected(service))
    app_openapi.install(app)

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
                "context": pair.context if pair else None,
                "speculation": service.decode.speculation(cfg.draft_tokens),
                "max_concurrency": service.max_concurrency, "slots_busy": service.slots_busy(),
                "slots": service.slots(), "queue_depth": len(service.queue),
                "concurrency": service.concurrency,
                "chat_template": text.chat_template(),
                # MTP drafts are judged without a grammar or penalties: such requests decode one token a step
                "not_speculated": ["response_format json", "tool_choice required or named", "logit_bias",
                                   "penalties", "top_k", "min_p", "logprobs"] if cfg.draft_tokens else [],
                **pictures.health()}
        return SafeJSONResponse(body, status_code=200 if up else 503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        check_api_key(request, cfg.api_key)
        return SafeJSONResponse(app.openapi())

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

    async def _tokens(request: Request, work, *what):
        """The prompt's token ids from the text workers (engine/service/proxy_text_pool.py): one client's
        share of them at a time (per address, and whether it showed the key)."""
        client = (request.client.host if request.client else "", cfg.api_key is not None
                  and has_api_key(request, cfg.api_key))
        try:
            return await work(client, *what)
        except ClientBusy as exc:
            raise ApiError(429, str(exc), headers={"Retry-After": "1"}) from None
        except TextFailed as exc:
            raise ApiError(400, str(exc), exc.field) from None

    def _context_limit() -> int | None:
        return (service.pair.max_context if service.pair else None) or cfg.max_context

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_api_key(request, cfg.api_key)
        _check_common(body, text)
        prompt = body.single_prompt()
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            prompt_ids = await _tokens(request, pool.encode, prompt)
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
        plan = tool_plan(body)
        messages = body.template_messages()
        for msg, m in zip(messages, body.messages):
            if m.media():  # the image placeholder where each image part is (engine.service.images)
                msg["content"] = pictures.text(m)
        prompt_text, prompt_ids = await _tokens(request, pool.chat, messages, plan.template_tools,
                                                body.chat_template_kwargs)
        prompt_ids = pictures.expand(prompt_ids, pics)
        reasoning = "none"
        if reasoning_parser(cfg.reasoning_parser, text):
            reasoning = "open" if prompt_opens_reasoning(prompt_text) else "detect"
        output = ChatOutput(reasoning=reasoning, tools=plan.parse_tools, forced=plan.forced)
        return await _serve(request, body, prompt_ids, body.requested_max_tokens(), "chat", output, plan.grammar,
                            pics)

    async def _serve(request: Request, body, prompt_ids: list[int], max_tokens: int | None, kind: str,
                     output: ChatOutput | None = None, grammar: dict | None = None, pics=()):
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
                                stop_token_ids=eos_ids, sampling=_sampling(body, text), grammar=grammar,
                                images=tuple(images.wire(pics)))
        try:
            job = service.submit(params, kind)
        except (Unavailable, QueueFull) as exc:
            status = 503 if isinstance(exc, Unavailable) else 429
            raise ApiError(status, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
        request.state.job = job
        request.state.log = {"kind": kind, "stream": body.stream, "seed": seed,
                             "prompt_tokens": len(prompt_ids), "max_tokens": params.max_tokens}
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        answer = Answer(kind, rid, int(time.time()), text, TextAssembler(text, body.stop_strings(), eos_ids), job,
                        output, logprobs=body.top_logprobs_count() is not None)
        if body.stream:
            return StreamingResponse(_stream(request, job, answer, body.include_usage(), body.continuous_usage()),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _complete(request, job, answer)

    async def _complete(request: Request, job: Job, answer: Answer):
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
                    answer.token(event[1], event[2])
                elif event[0] == "error":
                    _log(request, job, "error", error=event[2])
                    return SafeJSONResponse(error_body(event[1], event[2], None, "service_unavailable"
                                                   if event[1] == 503 else "server_error"),
                                        status_code=event[1], headers={"Retry-After": "5"} if event[1] == 503 else None)
                elif event[0] == "done":
                    answer.finish()
                    reason = answer.finish_reason(event[1])
                    _log(request, job, reason, usage=event[2])
                    return answer.body(reason, event[2])
        finally:
            gone.cancel()

    async def _stream(request: Request, job: Job, answer: Answer, include_usage: bool, continuous: bool = False):
        finished = False
        try:
            if answer.kind == "chat":
                yield _sse(answer.running_usage(answer.chunk({"role": "assistant", "content": ""}, None), continuous))
            while True:
                event = await job.events.get()
                if event[0] == "token":
                    for chunk in answer.token(event[1], event[2]) or ():
                        yield _sse(answer.running_usage(chunk, continuous))
                elif event[0] == "error":
                    finished = True
                    _log(request, job, "error", error=event[2])
                    yield _sse(error_body(event[1], event[2], None,
                                          "service_unavailable" if event[1] == 503 else "server_error"))
                    yield "data: [DONE]\n\n"
                    return
                elif event[0] == "done":
                    finished = True
                    for chunk in answer.finish():
                        yield _sse(answer.running_usage(chunk, continuous))
                    reason = answer.finish_reason(event[1])
                    _log(request, job, reason, usage=event[2])
                    yield _sse(answer.last_chunk(reason, event[2]))
                    if include_usage:  # OpenAI's stream_options.include_usage: one more chunk, no choices
                        yield _sse({**answer.chunk(None, None), "choices": [], "usage": usage_body(event[2])})
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
    # 400 as OpenAI and vLLM answer it (FastAPI's own status would be 422).
    return SafeJSONResponse(error_body(400, message, param, "invalid_request_error"), status_code=400)


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


def _sampling(body, text: ModelText) -> dict | None:
    """The generate message's "sampling" object (engine.core.logits_processors.Processing), None when plain."""
    bias = []
    for key, value in (body.logit_bias or {}).items():
        if not int(key) < text.vocab_size:
            raise ApiError(400, f"logit_bias: token id {key} is outside the vocabulary [0, {text.vocab_size})",
                           "logit_bias")
        bias.append([int(key), value])
    out = {"top_k": body.top_k_value(), "min_p": body.min_p, "presence_penalty": body.presence_penalty,
           "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
           "logit_bias": bias, "logprobs": body.top_logprobs_count()}
    plain = {"top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
             "logit_bias": [], "logprobs": None}
    return None if out == plain else out


def _check_text(value: str, field: str) -> None:
    """JSON may carry lone UTF-16 surrogates ("\\ud800") that no tokenizer can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{field}: contains a lone UTF-16 surrogate (U+{ord(value[exc.start]):04X}) "
                            f"at character {exc.start}; send valid Unicode text", field) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _log(request: Request, job: Job, outcome: str, **extra) -> None:
    fields = dict(getattr(request.state, "log", {}) or {})
    fields.update(outcome=outcome, **extra)
    request.state.log = fields


def _model_card(text: ModelText, max_model_len: int | None) -> dict:
    # max_model_len as vLLM names it: clients (the acceptance suite among them) learn the context limit.
    return {"id": text.model_id, "object": "model", "created": 0, "owned_by": "v100plan",
            "max_model_len": max_model_len}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
