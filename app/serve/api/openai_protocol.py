"""OpenAI-compatible request models, response bodies and error JSON."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.engine.request import RequestDelta
from app.engine.sampling_params import SamplingParams
from app.engine.structured.tools import ToolChoice
from app.serve.api.structured_request import StructuredFieldError, request_spec, tools_and_choice

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


class APIError(Exception):
    """Becomes OpenAI's error JSON with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # strict: "5" is not a number and true is not 1; unknown fields are ignored like OpenAI.
    # No inf/NaN anywhere: an infinite penalty or temperature has no meaning (and poisons the
    # batch's logits).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # what a generator takes
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # Far outside [0.01, 100] a penalty only overflows the logits (1e-300: inf, then NaN).
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=100)
    ignore_eos: bool = False
    user: str | None = None
    cache_salt: Any = None  # rejected: the operator sets it (see Ingress)
    # Structured outputs (app/serve/api/structured_request.py): OpenAI's and vLLM's forms.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def structured_spec(self):
        return request_spec(self.response_format, self.structured_outputs)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        # A temperature this close to 0 is greedy decoding (its limit); dividing logits by
        # 1e-300 or a denormal would overflow them instead (as vLLM, below 1e-5 is greedy).
        temperature = 0.0 if self.temperature < GREEDY_BELOW else self.temperature
        try:
            structured = self.structured_spec()
        except StructuredFieldError as e:
            raise APIError(400, str(e), param=e.param) from None
        try:
            return SamplingParams(
                n=self.n,
                temperature=temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                seed=self.seed,
                max_tokens=max_tokens or 16,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                structured=structured,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        strings = isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str)
        if strings and len(self.prompt) != 1:
            raise ValueError("only one prompt per request is supported")
        if self.echo:
            raise ValueError("echo is not supported")
        return self

    def to_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as the answer gave it


class MessageToolCall(BaseModel):
    """One call of an earlier assistant answer, sent back in the conversation; typed, so
    a template that reads `call.function.name` never meets a malformed one."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn answers this call

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(part["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # False: "required" makes exactly one call

    def to_params(self) -> SamplingParams:
        k = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, k)

    def structured_spec(self):
        tools, choice = tools_and_choice(self.tools, self.tool_choice, self.parallel_tool_calls)
        return request_spec(self.response_format, self.structured_outputs, tools, choice)

    def tool_mode(self) -> ToolChoice:
        """How tools constrain this request."""
        try:
            return tools_and_choice(self.tools, self.tool_choice, self.parallel_tool_calls)[1]
        except StructuredFieldError as e:
            raise APIError(400, str(e), param=e.param) from None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none when tool_choice is "none")."""
        return self.tools if self.tools and self.tool_mode().mode != "none" else None

    def conversation(self) -> list[dict[str, Any]]:
        try:
            return [chat_turn(m) for m in self.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None


def chat_turn(m: ChatMessage) -> dict[str, Any]:
    """A validated message as the chat template sees it (both APIs)."""
    turn: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls is not None:
        turn["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(deltas: list[RequestDelta], tokenizer) -> dict[str, Any] | None:
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    if not lps:
        return None
    return {
        "tokens": [tokenizer.decode([lp.token_id]) for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{tokenizer.decode([t]): v for t, v in lp.top} for lp in lps],
        "text_offset": [],
    }


def chat_logprobs(deltas: list[RequestDelta], tokenizer) -> dict[str, Any] | None:
    lps = [lp for d in deltas for lp in (d.logprobs or [])]
    if not lps:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def envelope(kind: str, request_id: str, model: str, choices: list, **extra) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }
