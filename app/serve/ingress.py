"""Ingress: the OpenAI-compatible HTTP API; tokenizes, validates and drives the replicas."""
# No `from __future__ import annotations`: FastAPI must see the real Request annotation.

import logging
import os
from typing import Any

import ray
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from app.kvstore.handoff import HandOffs
from app.serve.api.http_input import parse_request, read_limited
from app.serve.api.normalize import RequestNormalizer
from app.serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from app.serve.api.openapi_schema import json_operation
from app.serve.api.responses import error_from_exception, final_body, sse_chunks
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.config import ServeArgs
from app.serve.driver import RequestDriver
from app.serve.grpc_api.grpc_servicer import GrpcIngress
from app.serve.metrics import ReplicaMetrics
from app.serve.replicas.replica import resolve_model
from app.serve.routing.load_view import LoadView
from app.serve.routing.prefill_placement import PlacementConfig
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)
api = FastAPI(title="slimserve", docs_url=None, redoc_url=None)


@api.exception_handler(HTTPException)
async def _http_error(request: HTTPRequest, exc: HTTPException) -> Response:
    """404 (no such route), 405 (wrong method) and the like, as OpenAI error JSON."""
    what = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, exc.detail)
    err = APIError(exc.status_code, f"{request.method} {request.url.path}: {what}")
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


@api.exception_handler(RequestValidationError)
async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> Response:
    return JSONResponse(APIError(400, str(exc)).body(), status_code=400)


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress(GrpcIngress):  # gRPC adapter: app/serve/grpc_api/grpc_servicer.py
    """The HTTP adapter: JSON -> request model -> `RequestNormalizer` -> `RequestDriver`."""

    async def __init__(
        self,
        args: dict[str, Any],
        prefill: DeploymentHandle | None = None,
        decode: DeploymentHandle | None = None,
        engine: DeploymentHandle | None = None,
    ):
        self.args = ServeArgs(**args)
        model = resolve_model(self.args.engine.model)
        self.model_name = self.args.served_model_name or os.path.basename(model.rstrip("/"))
        self.tokenizer = Tokenizer.from_path(model)
        metrics = ReplicaMetrics("ingress", self.model_name)  # the client's view
        inbox = None
        if self.args.delta_channel == "socket":  # replicas connect here (delta_inbox.py)
            inbox = await DeltaInbox.start(ray.util.get_node_ip_address())
        hints = self.args.allow_routing_hints
        # disaggregated: in-band prefill results posted for their decode calls, and those
        # the decode calls of ended choices will not take
        hand_offs = HandOffs(self.args.store_name) if prefill is not None else None
        local = self.args.local_prefill_tokens if prefill is not None else 0
        view = config = None
        if prefill is not None:  # disaggregated: each prefill placed by load
            view = LoadView(prefill, decode, self.args.routing_stats_period_s, metrics)
            config = PlacementConfig.from_args(self.args)
        self.driver = RequestDriver(
            metrics, prefill, decode, engine, hints, hand_offs=hand_offs,
            local_prefill_tokens=local, inbox=inbox, load_view=view, placement_config=config,
        )  # fmt: skip
        self.normalizer = RequestNormalizer(
            self.args, self.model_name, self.tokenizer, self.driver.describe
        )
        await self.driver.warm_up()  # routers know their replicas before the first request
        if view is not None:
            view.start()

    def delta_inbox_stats(self) -> dict[str, int] | None:
        """The delta inbox's frames received, choices open and deltas refused (tests, ops);
        None with `delta_channel: serve`."""
        inbox = self.driver.inbox
        if inbox is None:
            return None
        return {"frames": inbox.frames, "open": inbox.num_open, "rejected": inbox.rejected}

    # --- routes -------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> Response:
        return JSONResponse({"status": "ok"})

    @api.get("/v1/models")
    async def models(self) -> Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "slimserve"}
        return JSONResponse({"object": "list", "data": [card]})

    @api.post("/v1/completions", openapi_extra=json_operation(CompletionRequest))
    async def completions(self, http: HTTPRequest) -> Response:
        return await self._serve(http, CompletionRequest)

    @api.post("/v1/chat/completions", openapi_extra=json_operation(ChatCompletionRequest))
    async def chat_completions(self, http: HTTPRequest) -> Response:
        return await self._serve(http, ChatCompletionRequest)

    # --- one request --------------------------------------------------------------
    async def _serve(self, http: HTTPRequest, model_cls) -> Response:
        try:
            body = await self._parse(http, model_cls)
            req = await self.normalizer.normalize(body, http.headers)
            stream = await self.driver.start(req)
            if req.stream:
                first = await stream.first()  # errors before any byte is sent are HTTP errors
                gen = sse_chunks(
                    stream, first, req.kind, req.request_id, self.model_name, self.tokenizer,
                    req.include_usage, req.tools,
                )  # fmt: skip
                return StreamingResponse(gen, media_type="text/event-stream")
            deltas = await stream.collect(timeout_s=self.args.request_timeout_s)
            out = final_body(
                req.kind, req.request_id, self.model_name, len(req.prompt_token_ids), deltas,
                self.tokenizer, req.tools,
            )  # fmt: skip
            if self.args.allow_routing_hints:  # operator/test view of where choices ran
                out["slimserve"] = {"choices": self.driver.placements(req)}
            return JSONResponse(out)
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI error JSON
            err = error_from_exception(e, self.args.retry_after_s)
            if err.status >= 500:
                log.exception("request failed")
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def _parse(self, http: HTTPRequest, model_cls):
        limit = self.args.max_request_bytes
        raw = await read_limited(http.stream(), http.headers.get("content-length"), limit)
        return await parse_request(raw, model_cls)
