"""One request normalisation for both APIs: a validated body becomes a `NormalizedRequest`.

The HTTP adapter (app/serve/ingress.py) parses JSON into the OpenAI request models; the gRPC
adapter (app/serve/grpc_api/grpc_servicer.py) converts the proto into the same models
(app/serve/grpc_api/grpc_convert.py). From there one path applies to both: the model name, the
operator-owned cache salt (tenant), the prompt (text, chat or token ids; tokenized off the
event loop), the prompt limits, the sampling parameters and routing hints. Everything after
this point (routing, engine replicas, responses) reads only the typed `NormalizedRequest`.

Engine-side ids are made here, never taken from the client: a gRPC `request_id` need not be
unique, and two calls with one id (from one tenant or two) must not meet on a replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.engine.sampling_params import SamplingParams, random_seed
from app.engine.structured.tools import ToolChoice
from app.serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from app.serve.config import ServeArgs
from app.serve.messages import GenerateRequest, RoutingInfo, prompt_chunk_keys, short_key

Body = CompletionRequest | ChatCompletionRequest
ROLES = ("prefill", "decode", "engine")
# Prompts of up to this many characters are tokenized on the event loop (2,048 characters
# took 0.5 ms with the default model's tokenizer, so ~0.06 ms here): a thread round trip
# (0.05 ms on an idle loop) sends the request to the back of the loop's ready queue, behind
# every stream's token events.
INLINE_PROMPT_CHARS = 256


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the engine replicas told the ingress (`EngineHost.describe`)."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    salt_base: tuple[str, ...]
    block_size: int
    chunk_tokens: int
    kv_cache_dtype: str  # the dtype the replicas' KV cache really uses (not "auto")

    @classmethod
    def from_describe(cls, d: dict[str, Any]) -> EngineInfo:
        return cls(
            max_model_len=int(d["max_model_len"]),
            vocab_size=int(d["vocab_size"]),
            eos_token_ids=frozenset(d["eos_token_ids"]),
            salt_base=tuple(d["salt_base"]),
            block_size=int(d["block_size"]),
            chunk_tokens=int(d["chunk_tokens"]),
            kv_cache_dtype=str(d.get("kv_cache_dtype", "")),
        )


@dataclass(frozen=True, slots=True)
class NormalizedRequest:
    """One API request, whichever API it came by, ready to be split into choices."""

    request_id: str  # the id the client sees (gRPC: the caller's, possibly not unique)
    engine_id: str  # unique per call: engine request ids are f"{engine_id}-{choice}"
    kind: str  # "text_completion" | "chat.completion"
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    stream: bool = False
    include_usage: bool = False
    hints: dict[str, int] = field(default_factory=dict)  # role -> forced replica index
    tools: ToolChoice | None = None  # chat: how tools shape the answer (tool_calls or text)

    def choice(self, index: int, info: EngineInfo, role: str) -> GenerateRequest:
        """The engine request for choice `index`; `role` picks the routing hint."""
        params = self.params
        if params.seed is None:  # picked here: prefill and decode replicas draw the same noise
            params = dataclasses.replace(params, seed=random_seed())
        elif params.n > 1:  # distinct but reproducible choices
            params = dataclasses.replace(params, seed=params.seed + index)
        keys = prompt_chunk_keys(
            self.prompt_token_ids, info.salt_base, self.cache_salt, info.block_size,
            info.chunk_tokens,
        )  # fmt: skip
        routing = RoutingInfo(
            len(self.prompt_token_ids), tuple(short_key(k) for k in keys), self.hints.get(role)
        )
        return GenerateRequest(
            f"{self.engine_id}-{index}", self.prompt_token_ids, params, self.cache_salt, routing
        )


def api_key(metadata: Mapping[str, str]) -> str:
    """The caller's API key: `authorization: Bearer <key>` or `x-api-key: <key>`."""
    key = metadata.get("authorization", "").removeprefix("Bearer ").strip()
    return key or metadata.get("x-api-key", "").strip()


class RequestNormalizer:
    """Validates and normalises request bodies for one served model (both APIs)."""

    def __init__(
        self,
        args: ServeArgs,
        model_name: str,
        tokenizer,
        describe: Callable[[], Awaitable[EngineInfo]],
    ):
        self.args, self.model_name, self.tokenizer = args, model_name, tokenizer
        self._describe = describe

    async def normalize(
        self,
        body: Body,
        metadata: Mapping[str, str],
        *,
        request_id: str | None = None,
        require_key: bool = False,
    ) -> NormalizedRequest:
        """`metadata`: HTTP headers or gRPC invocation metadata (lower-case names)."""
        self.check_model(body.model)
        if body.cache_salt is not None:
            raise APIError(
                400, "cache_salt is set by the operator, not the request", param="cache_salt"
            )
        salt = self.tenant_salt(metadata, require_key=require_key)
        info = await self._describe()
        prompt = await self.prompt(body, info)
        params = body.to_params()
        chat = isinstance(body, ChatCompletionRequest)
        engine_id = uuid.uuid4().hex
        return NormalizedRequest(
            request_id=request_id or ("chatcmpl-" if chat else "cmpl-") + engine_id,
            engine_id=engine_id,
            kind="chat.completion" if chat else "text_completion",
            prompt_token_ids=prompt,
            params=params,
            cache_salt=salt,
            stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            hints=self.routing_hints(metadata),
            tools=body.tool_mode() if chat else None,
        )

    def check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def tenant_salt(self, metadata: Mapping[str, str], *, require_key: bool) -> str | None:
        """The caller's cache salt, from its API key (or the operator's trusted header)."""
        key = api_key(metadata)
        salts = self.args.api_key_cache_salts
        if key in salts:
            return salts[key]
        if require_key:
            why = "is missing" if not key else "is not a known key"
            raise APIError(401, f"the API key {why}: send metadata 'authorization: Bearer <key>'")
        header = self.args.cache_salt_header
        return metadata.get(header.lower()) if header else None

    def routing_hints(self, metadata: Mapping[str, str]) -> dict[str, int]:
        if not self.args.allow_routing_hints:
            return {}
        hints = {}
        for role in ROLES:
            value = metadata.get(f"x-slimserve-{role}-replica")
            if value is not None and value.isdigit():
                hints[role] = int(value)
        return hints

    async def prompt(self, body: Body, info: EngineInfo) -> list[int]:
        """The prompt's token ids, checked against the vocabulary and the length limits.

        Tokenizing a long prompt takes a while (a 4 MB prompt: seconds): it runs in a worker
        thread so the ingress's event loop keeps answering other requests meanwhile. Token
        ids and short texts are done on the loop (a thread round trip costs more than them).
        """
        if _prompt_chars(body) <= INLINE_PROMPT_CHARS:
            prompt = self._tokens(body)
        else:
            prompt = await asyncio.to_thread(self._tokens, body)
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = info.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        limit = min(info.max_model_len - 1, self.args.max_prompt_tokens or 1 << 62)
        if len(prompt) > limit:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; at most {limit} are allowed",
                param="prompt",
                code="context_length_exceeded",
            )
        return prompt

    def _tokens(self, body: Body) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                return self.tokenizer.encode_chat(body.conversation(), body.template_tools())
            except ValueError as e:
                raise APIError(
                    400, f"cannot apply the chat template: {e}", param="messages"
                ) from None
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt)
        if body.prompt and isinstance(body.prompt[0], str):
            return self.tokenizer.encode(body.prompt[0])
        return list(body.prompt)


def _prompt_chars(body: Body) -> int:
    """The text `_tokens` would tokenize, in characters (0: token ids, nothing to do); a
    chat with tools or non-text content counts as long (its template renders more)."""
    if isinstance(body, ChatCompletionRequest):
        if body.tools or any(not isinstance(m.content, str | None) for m in body.messages):
            return INLINE_PROMPT_CHARS + 1
        return sum(len(m.content or "") for m in body.messages)
    if isinstance(body.prompt, str):
        return len(body.prompt)
    if body.prompt and isinstance(body.prompt[0], str):
        return len(body.prompt[0])
    return 0
