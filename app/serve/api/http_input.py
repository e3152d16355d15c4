"""HTTP request bodies: size-limited reading, JSON parsing and checks before pydantic.

Every malformed body becomes a 4xx `APIError` naming the problem, never a 500:
- over `max_request_bytes` -> 413 (checked on Content-Length and while reading);
- not UTF-8 JSON, or not an object -> 400;
- nested deeper than `MAX_JSON_DEPTH` -> 400 (json and pydantic recurse: ~1000 levels raised
  RecursionError);
- a string holding a lone UTF-16 surrogate ("\\ud800" is valid JSON but not Unicode text:
  the tokenizer raised TypeError) -> 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from app.serve.api.openai_protocol import APIError

MAX_JSON_DEPTH = 64  # OpenAI bodies nest ~6 deep; JSON schemas in tools and formats more
# Bodies up to this size are parsed on the event loop (tens of us). A worker-thread round
# trip puts the request back at the end of the loop's ready queue, behind every stream's
# token events: at 8 streams that wait was ~4 ms of a request's path (docs/performance.md,
# "Served TTFT: where it goes").
INLINE_BODY_BYTES = 16 << 10


async def read_limited(
    chunks: AsyncIterator[bytes], content_length: str | None, limit: int
) -> bytes:
    """The whole body, or 413 as soon as it is known to exceed `limit` bytes."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        parts.append(chunk)
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {limit} bytes (max_request_bytes)",
        code="request_too_large",
    )


async def parse_request(raw: bytes, model_cls):
    """`parse_body`, off the event loop when the body is large (megabytes of JSON take a
    while to parse and validate)."""
    if len(raw) <= INLINE_BODY_BYTES:
        return parse_body(raw, model_cls)
    return await asyncio.to_thread(parse_body, raw, model_cls)


def parse_body(raw: bytes, model_cls):
    """`raw` JSON validated as `model_cls`; 400 with the offending field otherwise."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"request body is not valid UTF-8 JSON: {e}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    check_json(data)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None


def _too_deep() -> APIError:
    return APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels")


def check_json(data: Any) -> None:
    """Depth and text checks over a parsed body, iteratively (no recursion to exhaust)."""
    todo: list[tuple[Any, tuple[str, ...]]] = [(data, ())]
    while todo:
        value, path = todo.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                todo.append((item, (*path, key)))
        elif isinstance(value, list):
            todo.extend((item, (*path, str(i))) for i, item in enumerate(value))


def _check_text(text: str, path: tuple[str, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        where = ".".join(path) or None
        bad = f"\\u{ord(text[e.start]):04x}"
        raise APIError(
            400,
            f"{where or 'request body'}: contains a lone surrogate ({bad}); "
            "strings must be valid Unicode text",
            param=where,
        ) from None
