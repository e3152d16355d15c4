"""Ingress: the OpenAI-compatible HTTP API; tokenizes, validates and drives the replicas."""
# No `from __future__ import annotations`: FastAPI must see the real Request annotation.

import asyncio
import dataclasses
import json
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.engine.request import RequestDelta
from app.serve.config import ServeArgs
from app.serve.grpc_servicer import GrpcIngress
from app.serve.messages import DecodeRequest, GenerateRequest, RoutingInfo, short_key
from app.serve.metrics import ReplicaMetrics
from app.serve.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from app.serve.replica import prompt_chunk_keys, resolve_model
from app.serve.responses import (
    DONE_REASONS,
    ChoiceStream,
    detokenized,
    error_from_exception,
    final_body,
    sse_chunks,
)
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
api = FastAPI(title="slimserve", docs_url=None, redoc_url=None)


# Module helpers sit above the class: @serve.deployment serializes it on definition.


async def _stream(response) -> AsyncIterator[Any]:
    """Iterate a streaming DeploymentResponseGenerator; cancel it if we stop early."""
    done = False
    try:
        async for item in response:
            yield item
        done = True
    finally:
        if not done:
            response.cancel()


def _with(params, **changes):
    return dataclasses.replace(params, **changes)


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress(GrpcIngress):  # gRPC methods: app/serve/grpc_servicer.py
    def __init__(
        self,
        args: dict[str, Any],
        prefill: DeploymentHandle | None = None,
        decode: DeploymentHandle | None = None,
        engine: DeploymentHandle | None = None,
    ):
        self.args = ServeArgs(**args)
        self.prefill, self.decode, self.engine = prefill, decode, engine
        model = resolve_model(self.args.engine.model)
        self.model_name = self.args.served_model_name or os.path.basename(model.rstrip("/"))
        self.tokenizer = Tokenizer.from_path(model)
        self.metrics = ReplicaMetrics("ingress", self.model_name)  # the client's view
        self._info: dict[str, Any] | None = None
        self._placement: dict[str, dict[str, Any]] = {}  # request id -> where it ran (debug)

    # --- routes -------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self) -> Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slimserve"}
        return JSONResponse({"object": "list", "data": [card]})

    @api.post("/v1/completions")
    async def completions(self, http: HTTPRequest) -> Response:
        return await self._serve(http, CompletionRequest, "text_completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, http: HTTPRequest) -> Response:
        return await self._serve(http, ChatCompletionRequest, "chat.completion")

    # --- one request --------------------------------------------------------------
    async def _serve(self, http: HTTPRequest, model_cls, kind: str) -> Response:
        try:
            body = await self._parse(http, model_cls)
            info = await self._describe()
            prompt = self._prompt(body, info)
            params = body.to_params()
            salt = self._cache_salt(http, body)
            rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
            eos = frozenset(info["eos_token_ids"])
            choices = [
                detokenized(
                    self._choice(self._generate_request(rid, i, prompt, params, salt, info, http)),
                    self.tokenizer,
                    params,
                    eos,
                )
                for i in range(params.n)
            ]
            stream = ChoiceStream(choices)
            if body.stream:
                first = await stream.first()  # errors before any byte is sent are HTTP errors
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                gen = sse_chunks(
                    stream, first, kind, rid, self.model_name, self.tokenizer, include_usage
                )
                return StreamingResponse(gen, media_type="text/event-stream")
            deltas = await stream.collect(timeout_s=self.args.request_timeout_s)
            out = final_body(kind, rid, self.model_name, len(prompt), deltas, self.tokenizer)
            placement = [self._placement.pop(f"{rid}-{i}", None) for i in range(params.n)]
            if self.args.allow_routing_hints:  # operator/test view of where choices ran
                out["slimserve"] = {"choices": placement}
            return JSONResponse(out)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI error JSON
            err = error_from_exception(e, self.args.retry_after_s)
            if err.status >= 500:
                log.exception("request failed")
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def _parse(self, http: HTTPRequest, model_cls):
        raw = await http.body()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, f"request body is not valid UTF-8 JSON: {e}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{where}: {first['msg']}", param=where) from None
        if body.model != self.model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.cache_salt is not None:
            raise APIError(
                400, "cache_salt is set by the operator, not the request", param="cache_salt"
            )
        return body

    def _prompt(self, body, info: dict[str, Any]) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            try:
                prompt = self.tokenizer.encode_chat(body.conversation())
            except ValueError as e:
                raise APIError(
                    400, f"cannot apply the chat template: {e}", param="messages"
                ) from None
        elif isinstance(body.prompt, str):
            prompt = self.tokenizer.encode(body.prompt)
        elif body.prompt and isinstance(body.prompt[0], str):
            prompt = self.tokenizer.encode(body.prompt[0])
        else:
            prompt = list(body.prompt)
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = info["vocab_size"]
        if any(t < 0 or t >= vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        limit = min(info["max_model_len"] - 1, self.args.max_prompt_tokens or 1 << 62)
        if len(prompt) > limit:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; at most {limit} are allowed",
                param="prompt",
                code="context_length_exceeded",
            )
        return prompt

    def _cache_salt(self, http: HTTPRequest, body) -> str | None:
        auth = http.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip()
        if key and key in self.args.api_key_cache_salts:
            return self.args.api_key_cache_salts[key]
        header = self.args.cache_salt_header
        return http.headers.get(header) if header else None

    def _generate_request(self, rid, index, prompt, params, salt, info, http) -> GenerateRequest:
        if params.seed is not None and params.n > 1:  # distinct but reproducible choices
            params = _with(params, seed=params.seed + index)
        keys = prompt_chunk_keys(
            prompt, info["salt_base"], salt, info["block_size"], info["chunk_tokens"]
        )
        hint = self._hint(http, "prefill" if self.prefill else "engine")
        routing = RoutingInfo(len(prompt), tuple(short_key(k) for k in keys), hint)
        return GenerateRequest(f"{rid}-{index}", prompt, params, salt, routing)

    def _hint(self, http: HTTPRequest, role: str) -> int | None:
        if not self.args.allow_routing_hints:
            return None
        value = http.headers.get(f"x-slimserve-{role}-replica")
        return int(value) if value is not None and value.isdigit() else None

    async def _describe(self) -> dict[str, Any]:
        if self._info is None:
            handle = self.prefill or self.engine
            self._info = await handle.describe.remote()
        return self._info

    def _choice(self, gen: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """One choice's deltas, timed: TTFT, inter-token and e2e latency, token counts."""
        return self.metrics.timed(self._choice_deltas(gen), len(gen.prompt_token_ids))

    async def _choice_deltas(self, gen: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """The deltas of one choice: prefill then decode, or one colocated engine."""
        if self.engine is not None:
            async for delta in _stream(self.engine.options(stream=True).generate.remote(gen)):
                yield delta
            return
        response = self.prefill.prefill.remote(gen)
        try:
            result = await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        if self.args.allow_routing_hints:
            if len(self._placement) > 1024:  # streams never collect theirs: stay bounded
                self._placement.pop(next(iter(self._placement)))
            self._placement[gen.request_id] = {
                "prefill_replica": result.replica,
                "store_tokens": result.num_store_tokens,
                "store_failures": result.store_failures,
            }
        yield result.first
        if result.first.finish_reason in DONE_REASONS:
            return
        routing = RoutingInfo(gen.routing.num_tokens, gen.routing.chunk_keys, None)
        request = DecodeRequest(gen, result, routing)
        async for delta in _stream(self.decode.options(stream=True).generate.remote(request)):
            yield delta
