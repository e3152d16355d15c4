"""What `/openapi.json` says of the OpenAI routes, which read their raw body themselves.

The routes take a raw `Request` (size limit, JSON parsed off the event loop, one error
format: app/serve/api/http_input.py), so FastAPI sees no body parameter and documents none.
`json_operation(Model)` is the route decorator's `openapi_extra`: the request body is the
pydantic model's JSON schema and the error answers are OpenAI error JSON, so clients and
schema-driven fuzzers (schemathesis, tests/reliability/serve) see what the server accepts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}
# The statuses a body can earn (docs/serving.md "Input hardening", "Admission").
ERRORS = {
    "400": "invalid request (the message names the field)",
    "401": "missing or unknown API key (when keys are required)",
    "404": "unknown model",
    "413": "body over max_request_bytes",
    "429": "overloaded: retry after the Retry-After header's seconds",
    "503": "no replica can take it now: retry after the Retry-After header's seconds",
}


def inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """The model's JSON schema with every `#/$defs/X` reference replaced by X itself.

    In an OpenAPI document `#` is the document's root, not the embedded schema, so pydantic's
    `$defs` cannot stay where they are. A recursive model cannot be inlined: ValueError."""
    defs = schema.get("$defs", {})

    def resolve(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [resolve(x, seen) for x in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            name = ref.removeprefix("#/$defs/")
            if name in seen:
                raise ValueError(f"recursive schema through {name}")
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return resolve(defs[name], (*seen, name)) | resolve(rest, seen)
        return {k: resolve(v, seen) for k, v in node.items() if k != "$defs"}

    return resolve(schema, ())


def json_operation(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a POST route whose JSON body is `model`: JSON, or server-sent
    events with `"stream": true`; errors as OpenAI error JSON."""
    error = {"application/json": {"schema": ERROR_BODY}}
    answer = {
        "description": "the answer (JSON), or its server-sent events when stream is true",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # one schema per event: `data` is a JSON chunk, an error, or [DONE]
            "text/event-stream": {"schema": SSE_EVENT},
        },
    }
    responses = {code: {"description": why, "content": error} for code, why in ERRORS.items()}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": inline_refs(model.model_json_schema())}},
        },
        "responses": {"200": answer, **responses},
    }
