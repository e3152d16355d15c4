"""slimserve.v1 messages <-> the HTTP side's request models and the engine's deltas.

A gRPC request is turned into the same pydantic body the HTTP API validates, so both APIs
share defaults, ranges and error messages; errors become gRPC status codes here.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

import grpc
from pydantic import ValidationError
from ray.serve.exceptions import (
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
)

from app.engine.request import RequestDelta, TokenLogprob
from app.engine.structured.tools import ToolChoice
from app.serve.api.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    chat_turn,
)
from app.serve.api.responses import error_from_exception
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_structured import StreamToolCalls, choice_tool_calls, structured_fields

_FINISH = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_SAMPLING_NAMES = frozenset(
    _OPTIONAL_SAMPLING + ("n", "stop", "stop_token_ids", "ignore_eos", "logprobs")
)
_REQUEST_ID_CHARS = frozenset(map(chr, range(0x21, 0x7F)))


# --- requests -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """Stands in for a request message the proxy could not parse."""

    reason: str

    def error(self) -> APIError:
        return APIError(400, f"the request message does not parse: {self.reason}")


def parsed(request):
    """The request message; INVALID_ARGUMENT if the proxy could not parse it."""
    if isinstance(request, MalformedRequest):
        raise request.error()
    return request


def http_body(req: pb.GenerateRequest, model: str) -> CompletionRequest | ChatCompletionRequest:
    """The HTTP API's request model for this gRPC request (validated the same way)."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise APIError(400, "input: set exactly one of text, chat or token_ids", param="input")
    fields: dict[str, Any] = {"model": req.model or model, **_sampling_fields(req)}
    fields |= structured_fields(req, chat=kind == "chat")  # app/serve/grpc_api/grpc_structured.py
    logprobs = req.sampling.logprobs if req.sampling.HasField("logprobs") else None
    if kind == "chat":
        fields["messages"] = [chat_message_fields(m) for m in req.chat.messages]
        fields |= {"logprobs": logprobs is not None, "top_logprobs": logprobs}
        return _validate(ChatCompletionRequest, fields)
    fields["prompt"] = req.text if kind == "text" else list(req.token_ids.ids)
    fields["logprobs"] = logprobs
    return _validate(CompletionRequest, fields)


def _sampling_fields(req: pb.GenerateRequest) -> dict[str, Any]:
    s = req.sampling
    out: dict[str, Any] = {
        name: getattr(s, name) for name in _OPTIONAL_SAMPLING if s.HasField(name)
    }
    if s.n:
        out["n"] = s.n
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    out["ignore_eos"] = s.ignore_eos
    return out


def _validate(model_cls, fields: dict[str, Any]):
    try:
        return model_cls.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"]]
        if loc and loc[0] == "top_logprobs":
            loc[0] = "logprobs"  # the chat model's name for SamplingParams.logprobs
        if loc and loc[0] in _SAMPLING_NAMES:
            loc.insert(0, "sampling")
        if loc and loc[0] == "messages":
            loc[0] = "chat.messages"
        where = ".".join(loc) or "request"
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None


def chat_message_fields(m: pb.ChatMessage) -> dict[str, Any]:
    """One turn as the HTTP API's message JSON: tool calls in OpenAI's shape."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def conversation(chat: pb.Chat) -> list[dict[str, Any]]:
    """Chat turns as the tokenizer's template wants them; checked like the HTTP API."""
    if not chat.messages:
        raise APIError(400, "chat.messages: at least one message is required")
    try:
        turns = [ChatMessage.model_validate(chat_message_fields(m)) for m in chat.messages]
    except ValidationError as e:
        raise APIError(400, f"chat.messages: {e.errors()[0]['msg']}") from None
    return [chat_turn(t) for t in turns]


def call_timeout_s(req: pb.GenerateRequest, server_timeout_s: float) -> float:
    """The call's time limit: the client's `timeout_s` (its deadline, which Serve's proxy
    does not hand over) capped by the server's request_timeout_s."""
    if not req.HasField("timeout_s") or req.timeout_s == 0:
        return server_timeout_s
    if not req.timeout_s > 0 or math.isinf(req.timeout_s):  # NaN fails the first test
        raise APIError(400, "timeout_s: must be a positive number of seconds", param="timeout_s")
    return min(req.timeout_s, server_timeout_s)


def request_id(req: pb.GenerateRequest, fallback: str) -> str:
    rid = req.request_id
    if not rid:
        return fallback
    if len(rid) > 128 or not set(rid) <= _REQUEST_ID_CHARS:
        raise APIError(400, "request_id: at most 128 printable ASCII characters, no spaces")
    return rid


# --- responses ----------------------------------------------------------------------


def logprobs_pb(lps: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps or []
    ]


def finish_reason(delta: RequestDelta) -> int:
    return _FINISH.get(delta.finish_reason or "", 0) if delta.finished else 0


@dataclass(slots=True)
class UsageCounter:
    """Counts a request's tokens over its choices' deltas; knows when the last one ended."""

    num_prompt: int
    num_choices: int
    completion: int = 0
    cached: int = 0
    finished: int = 0
    started: set[int] = field(default_factory=set)

    def add(self, delta: RequestDelta) -> bool:
        """Count one delta; True when it is the request's last."""
        self.completion += len(delta.new_token_ids)
        if delta.index not in self.started:
            self.started.add(delta.index)
            self.cached = max(self.cached, delta.num_cached_tokens)
        self.finished += int(delta.finished)
        return self.finished == self.num_choices

    def usage(self) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=self.num_prompt,
            completion_tokens=self.completion,
            total_tokens=self.num_prompt + self.completion,
            cached_prompt_tokens=self.cached,
        )


def stream_message(
    delta: RequestDelta, rid: str, calls: StreamToolCalls | None = None
) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=rid,
        index=delta.index,
        token_ids=delta.new_token_ids,
        text=delta.text_delta,
        logprobs=logprobs_pb(delta.logprobs),
        finish_reason=finish_reason(delta),
    )
    if calls is not None:  # tool_choice REQUIRED or named: tool-call deltas beside the text
        reason = delta.finish_reason if delta.finished else None
        tool_calls, reason = calls.delta(delta.index, delta.text_delta, reason)
        message.tool_calls.extend(tool_calls)
        message.finish_reason = _FINISH.get(reason or "", 0)
    return message


def complete_message(
    rid: str,
    model: str,
    per_choice: list[list[RequestDelta]],
    counter: UsageCounter,
    tools: ToolChoice | None = None,
) -> pb.CompleteResponse:
    choices = []
    for index, deltas in enumerate(per_choice):
        for d in deltas:
            counter.add(d)
        last = next((d for d in reversed(deltas) if d.finished), None)
        text = "".join(d.text_delta for d in deltas)
        reason = finish_reason(last) if last else 0
        calls: list[pb.ToolCall] = []
        if tools is not None and tools.constrained and last is not None:
            calls, why = choice_tool_calls(text, last.finish_reason, tools)
            reason = _FINISH.get(why or "", 0)
        choices.append(
            pb.Choice(
                index=index,
                text=text,
                token_ids=[t for d in deltas for t in d.new_token_ids],
                logprobs=logprobs_pb([lp for d in deltas for lp in d.logprobs or []]),
                finish_reason=reason,
                tool_calls=calls,
            )
        )
    return pb.CompleteResponse(request_id=rid, model=model, choices=choices, usage=counter.usage())


# --- errors -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GrpcError:
    code: grpc.StatusCode
    message: str
    trailers: tuple[tuple[str, str], ...] = ()


def grpc_error(e: BaseException, retry_after_s: int) -> GrpcError:
    """The status a caller gets for ``e``; INTERNAL only for the server's own faults."""
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return GrpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request timed out: {e}".rstrip(": "))
    if isinstance(e, RequestCancelledError):
        return GrpcError(grpc.StatusCode.CANCELLED, "the request was cancelled")
    if isinstance(e, DeploymentUnavailableError | ReplicaUnavailableError):
        e = APIError(503, "no healthy model replica is available; retry the request")
    err = e if isinstance(e, APIError) else error_from_exception(e, retry_after_s)
    code = _CODES.get(err.status, grpc.StatusCode.INTERNAL)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        message = f"the server is overloaded; retry after {retry_after_s}s"
    elif code == grpc.StatusCode.UNAVAILABLE:
        message = f"{err.message.rstrip('.')} (retry after {retry_after_s}s)"
    else:
        return GrpcError(code, err.message)
    return GrpcError(code, message, (("retry-after", str(retry_after_s)),))
