"""/openapi.json as the service answers: every refusal is a 400 (never FastAPI's 422), and each route lists
the statuses it gives with OpenAI's error body, so a schema-driven client or fuzzer expects what it gets."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["integer", "string", "null"]}}}},
}

# What each kind of route may answer besides 200.
_GENERATE = {"400": "a field is invalid or not served (param names it)", "401": "missing or wrong API key",
             "404": "the model is not served here", "413": "the body is over the limit",
             "429": "the queue is full (Retry-After)", "499": "the client closed the request",
             "500": "the engine could not complete the request", "503": "the ranks are not up (Retry-After)"}
_KEYED = {"401": "missing or wrong API key"}


def install(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
            for schemas in (schema["components"]["schemas"],):
                schemas.pop("HTTPValidationError", None)
                schemas.pop("ValidationError", None)
            for path, ops in schema.get("paths", {}).items():
                for method, op in ops.items():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    extra = _GENERATE if method == "post" else (_KEYED if path != "/health" else {})
                    if path.startswith("/v1/models/"):
                        extra = {**_KEYED, "404": "the model is not served here"}
                    for status, why in extra.items():
                        responses.setdefault(status, {"description": why, "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
