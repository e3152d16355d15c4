"""Fan-in of a request's choices, OpenAI response bodies and SSE, and error mapping."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from app.engine.request import OverloadedError, RequestDelta
from app.engine.structured.tools import ToolChoice
from app.kvstore.handoff import HandOffLost
from app.serve.api.openai_protocol import (
    APIError,
    chat_logprobs,
    completion_logprobs,
    envelope,
    usage,
)
from app.serve.api.tool_calls import ToolCallStream, chat_message
from app.serve.messages import DONE_REASONS

_END = object()


async def choice_deltas(deltas: AsyncIterator[RequestDelta]) -> AsyncIterator[RequestDelta]:
    """One choice's deltas, with the text the engines made (the text is made once).

    Each engine detokenizes and finds stop strings where its tokens are sampled; in
    disaggregated mode the decode replica's detokenizer continues after the prefill's
    first token (`IncrementalDetokenizer.primed`), so a stop string may span the two and
    the text equals the colocated one. A prefill's first delta is finished for its replica
    but not for the choice: only a reason in DONE_REASONS ends the choice.
    """
    async for d in deltas:
        done = d.finished and d.finish_reason in DONE_REASONS
        if not done and (d.finished or d.finish_reason is not None):  # copied only then
            d = dataclasses.replace(d, finished=False, finish_reason=None)
        yield d
        if done:
            return


class Admission:
    """Whether every choice of a request got a place on the replicas that will finish it.

    A streamed answer commits to "200 OK" with its first byte, so the ingress waits until
    each choice is admitted (decode replica assigned, or colocated engine streaming) before
    sending anything: an overloaded server then answers 429 / RESOURCE_EXHAUSTED, not a 200
    stream that ends in an in-band rate-limit error.
    """

    def __init__(self, num_choices: int):
        self._left = num_choices
        self._decided = asyncio.Event()
        self._error: BaseException | None = None

    def ticket(self) -> AdmissionTicket:
        return AdmissionTicket(self)

    def _admit(self) -> None:
        self._left -= 1
        if self._left <= 0:
            self._decided.set()

    def _refuse(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._decided.set()

    async def wait(self) -> None:
        await self._decided.wait()
        if self._error is not None:
            raise self._error


class AdmissionTicket:
    """One choice's part: admitted once, or refused if it fails before that."""

    def __init__(self, admission: Admission):
        self._admission, self._open = admission, True

    def admit(self) -> None:
        if self._open:
            self._open = False
            self._admission._admit()

    def refuse(self, error: BaseException) -> None:
        if self._open:
            self._open = False
            self._admission._refuse(error)


class ChoiceStream:
    """Runs each choice's delta stream as a task; yields deltas (index = choice) as they come."""

    def __init__(
        self, choices: list[AsyncIterator[RequestDelta]], admission: Admission | None = None
    ):
        self._choices = choices
        self.admission = admission
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._open = len(choices)

    def _start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._pump(i, c)) for i, c in enumerate(self._choices)
            ]

    async def _pump(self, index: int, choice: AsyncIterator[RequestDelta]) -> None:
        try:
            async for delta in choice:
                if delta.index != index:  # engine requests are per choice: index 0 there
                    delta = dataclasses.replace(delta, index=index)
                self._queue.put_nowait(delta)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait(e)
        finally:
            self._queue.put_nowait(_END)

    async def next(self) -> RequestDelta | None:
        """The next delta of any choice; None once every choice has ended."""
        self._start()
        while self._open:
            item = await self._queue.get()
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.close()
                raise item
            return item
        return None

    async def first(self) -> RequestDelta | None:
        """The first delta, once every choice is admitted (errors here precede any byte)."""
        try:
            first = await self.next()
            if self.admission is not None:
                await self.admission.wait()
            return first
        except BaseException:
            self.close()
            raise

    async def collect(self, timeout_s: float) -> list[list[RequestDelta]]:
        out: list[list[RequestDelta]] = [[] for _ in self._choices]

        async def drain() -> None:
            while (delta := await self.next()) is not None:
                out[delta.index].append(delta)

        try:
            await asyncio.wait_for(drain(), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(504, f"request took longer than {timeout_s}s", type="timeout") from None
        finally:
            self.close()
        return out

    def close(self) -> None:
        """Cancel what is still running: downstream replicas abort and free the KV blocks."""
        for task in self._tasks:
            if not task.done():
                task.cancel()


def final_body(
    kind,
    rid,
    model,
    num_prompt,
    per_choice: list[list[RequestDelta]],
    tokenizer,
    tools: ToolChoice | None = None,
):
    choices, completion_tokens, cached = [], 0, 0
    for i, deltas in enumerate(per_choice):
        text = "".join(d.text_delta for d in deltas)
        completion_tokens += sum(len(d.new_token_ids) for d in deltas)
        cached = max([cached] + [d.num_cached_tokens for d in deltas[:1]])
        reason = next((d.finish_reason for d in reversed(deltas) if d.finished), None)
        if kind == "chat.completion":
            message, reason = chat_message(text, reason, tools)
            lps = chat_logprobs(deltas, tokenizer)
            choices.append(
                {"index": i, "message": message, "logprobs": lps, "finish_reason": reason}
            )
        else:
            lps = completion_logprobs(deltas, tokenizer)
            choices.append({"index": i, "text": text, "logprobs": lps, "finish_reason": reason})
    return envelope(kind, rid, model, choices, usage=usage(num_prompt, completion_tokens, cached))


async def sse_chunks(
    stream: ChoiceStream,
    first: RequestDelta | None,
    kind: str,
    rid: str,
    model: str,
    tokenizer,
    include_usage: bool,
    tools: ToolChoice | None = None,
) -> AsyncIterator[bytes]:
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    calls = ToolCallStream(tools) if tools is not None and tools.constrained else None
    started: set[int] = set()
    num_prompt, completion_tokens, cached = 0, 0, 0
    delta = first
    try:
        while delta is not None:
            num_prompt = max(num_prompt, delta.num_prompt_tokens)
            completion_tokens += len(delta.new_token_ids)
            if delta.index not in started:
                cached = max(cached, delta.num_cached_tokens)
            choice = _stream_choice(kind, delta, delta.index not in started, tokenizer, calls)
            started.add(delta.index)
            yield _sse(envelope(chunk_kind, rid, model, [choice]))
            delta = await stream.next()
        if include_usage:
            body = envelope(chunk_kind, rid, model, [])
            body["usage"] = usage(num_prompt, completion_tokens, cached)
            yield _sse(body)
    except APIError as e:
        yield _sse(e.body())
    except Exception as e:  # noqa: BLE001 - the status line is gone: report in-band
        yield _sse(error_from_exception(e, 1).body())
    finally:
        stream.close()
    yield b"data: [DONE]\n\n"


def _stream_choice(
    kind: str, delta: RequestDelta, first: bool, tokenizer, calls: ToolCallStream | None = None
) -> dict[str, Any]:
    reason = delta.finish_reason if delta.finished else None
    if kind == "chat.completion":
        content: dict[str, Any] = {"content": delta.text_delta}
        if calls is not None:  # a constrained tool call: tool_calls deltas, not content
            content, reason = calls.delta(delta.index, delta.text_delta, reason)
        if first:
            content["role"] = "assistant"
        lps = chat_logprobs([delta], tokenizer)
        return {"index": delta.index, "delta": content, "logprobs": lps, "finish_reason": reason}
    lps = completion_logprobs([delta], tokenizer)
    return {
        "index": delta.index,
        "text": delta.text_delta,
        "logprobs": lps,
        "finish_reason": reason,
    }


def _sse(body: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def error_from_exception(e: BaseException, retry_after_s: int) -> APIError:
    cause = getattr(e, "cause", None) if isinstance(e, RayTaskError) else e
    busy = {"Retry-After": str(retry_after_s)}
    if isinstance(e, BackPressureError) or isinstance(cause, OverloadedError | BackPressureError):
        msg = "the server is overloaded; retry after the Retry-After delay"
        return APIError(429, msg, type="rate_limit_error", code="overloaded", headers=busy)
    if isinstance(cause, APIError):
        return cause
    if isinstance(cause, ValueError):
        return APIError(400, str(cause))
    if isinstance(e, RayActorError) or isinstance(cause, RayActorError | HandOffLost):
        msg = "a model replica became unavailable; retry the request"
        return APIError(503, msg, type="server_error", code="unavailable", headers=busy)
    return APIError(500, f"internal error: {type(e).__name__}", type="server_error")
