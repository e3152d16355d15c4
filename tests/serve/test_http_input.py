"""Malformed HTTP bodies become 4xx OpenAI errors naming the problem (no Ray needed).

The end-to-end versions (status line + error JSON through Serve) are in test_openai_api.py.
"""

import asyncio
import threading

import pytest
from pydantic import BaseModel, field_validator

from app.serve.api.http_input import (
    INLINE_BODY_BYTES,
    MAX_JSON_DEPTH,
    parse_body,
    parse_request,
    read_limited,
)
from app.serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest


def error_of(raw: bytes, model_cls=CompletionRequest) -> APIError:
    with pytest.raises(APIError) as e:
        parse_body(raw, model_cls)
    return e.value


def test_deep_nesting_is_400_not_recursion_error():
    """Seen failing before http_input existed: json.loads raised RecursionError -> 500."""
    for depth in (1000, 100_000, MAX_JSON_DEPTH + 2):
        raw = b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
        err = error_of(raw)
        assert err.status == 400 and "nested deeper" in err.message
    ok = b'{"model": "tiny", "prompt": "hi", "x": ' + b"[" * 8 + b"]" * 8 + b"}"
    assert parse_body(ok, CompletionRequest).prompt == "hi"


@pytest.mark.parametrize(
    "raw,where,model_cls",
    [
        (b'{"model": "tiny", "prompt": "a\\ud800b"}', "prompt", CompletionRequest),
        (b'{"model": "tiny", "prompt": ["\\udfff"]}', "prompt.0", CompletionRequest),
        (
            b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
            ChatCompletionRequest,
        ),
        (b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}', "stop.0", CompletionRequest),
    ],
)
def test_lone_surrogate_is_400_naming_the_field(raw, where, model_cls):
    """Seen failing before the check: the tokenizer raised TypeError on the str -> 500."""
    err = error_of(raw, model_cls)
    assert err.status == 400 and "lone surrogate" in err.message and err.param == where
    # A proper surrogate pair is one character (U+1F600) and fine.
    pair = b'{"model": "tiny", "prompt": "\\ud83d\\ude00"}'
    assert parse_body(pair, CompletionRequest).prompt == "\U0001f600"


@pytest.mark.parametrize(
    "raw,words",
    [
        (b'{"model": "tiny", "prompt": {"a": 1}}', "prompt"),
        (b'{"model": "tiny", "prompt": "hi", "stop": 5}', "stop"),
        (b'{"model": "tiny", "prompt": "hi", "seed": 1e400}', "seed"),
        (b'{"model": "tiny", "prompt": "hi", "repetition_penalty": 1e400}', "repetition_penalty"),
        (b'{"model": "tiny", "prompt": "hi", "n": 1.5}', "n"),
        (b'{"model": 5, "prompt": "hi"}', "model"),
        (b"null", "object"),
    ],
)
def test_wrong_types_are_400_naming_the_field(raw, words):
    err = error_of(raw)
    assert err.status == 400 and words in err.message


def test_malformed_tool_call_in_a_message_is_400_naming_it():
    """Tool calls sent back in a conversation are typed. Seen failing with them untyped
    (list[dict]): {"a": 1} was accepted and the tool-rendering test template then raised
    jinja2's UndefinedError ('dict object' has no attribute 'function'), a 500."""
    raw = b'{"model": "tiny", "messages": [{"role": "assistant", "tool_calls": [{"a": 1}]}]}'
    err = error_of(raw, ChatCompletionRequest)
    assert err.status == 400 and err.param == "messages.0.tool_calls.0.id"


def test_body_size_limit_is_413():
    async def chunks(parts):
        for p in parts:
            yield p

    async def read(parts, length):
        return await read_limited(chunks(parts), length, limit=10)

    assert asyncio.run(read([b"12345", b"67890"], "10")) == b"1234567890"
    for parts, length in (([b"x"], "11"), ([b"123456", b"78901"], None)):
        with pytest.raises(APIError) as e:
            asyncio.run(read(parts, length))
        assert e.value.status == 413 and "max_request_bytes" in e.value.message


PARSE_THREADS: list[int] = []  # the thread each ThreadRecordingBody was validated on


class ThreadRecordingBody(BaseModel):
    text: str

    @field_validator("text")
    @classmethod
    def _record(cls, v: str) -> str:
        PARSE_THREADS.append(threading.get_ident())
        return v


def test_small_bodies_are_parsed_on_the_event_loop_large_ones_off_it():
    """A thread round trip sends the request to the back of the loop's queue (~4 ms at 8
    streams, docs/performance.md): small bodies are parsed on the loop, large ones (JSON
    of megabytes takes a while) in a worker thread.

    Seen failing: with the size check inverted, both ran on the wrong thread.
    """
    pad = INLINE_BODY_BYTES - len(b'{"text": ""}')

    async def main() -> list[bool]:
        loop_thread = threading.get_ident()
        on_loop = []
        for size in (pad, pad + 1):
            raw = b'{"text": "' + b"x" * size + b'"}'
            body = await parse_request(raw, ThreadRecordingBody)
            assert len(body.text) == size
            on_loop.append(PARSE_THREADS[-1] == loop_thread)
        return on_loop

    assert asyncio.run(main()) == [True, False]
