"""The slimserve.v1.Generation and grpc.health.v1.Health services, served by Serve's gRPC proxy.

Ray Serve's gRPC proxy routes every call to the ingress deployment of the application named
in the `application` metadata (or of the only application) and calls the method named like
the RPC. An application has exactly one ingress, so these methods live on the same Ingress
deployment as the HTTP routes (`Ingress` inherits `GrpcIngress`). This is the gRPC adapter:
the proto becomes the HTTP API's request model (app/serve/grpc_api/grpc_convert.py), then the shared
`RequestNormalizer` and `RequestDriver` (the attributes declared on `GrpcIngress`) do the rest.

Cancellation: when a client cancels or its deadline passes, gRPC cancels the proxy's call;
the proxy cancels this replica's request, which cancels the choice streams, whose engine
replicas abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from ray import serve
from ray.serve.grpc_util import RayServegRPCContext

from app.engine.structured.tools import ToolChoice
from app.serve.api.normalize import RequestNormalizer
from app.serve.api.openai_protocol import APIError
from app.serve.api.responses import ChoiceStream
from app.serve.config import ServeArgs
from app.serve.driver import RequestDriver
from app.serve.grpc_api.grpc_convert import (
    GrpcError,
    UsageCounter,
    call_timeout_s,
    complete_message,
    conversation,
    grpc_error,
    http_body,
    parsed,
    request_id,
    stream_message,
)
from app.serve.grpc_api.grpc_gen.grpc.health.v1 import health_pb2
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_registration import add_slimserve_grpc_servicers
from app.serve.grpc_api.grpc_structured import StreamToolCalls

# deploy/*.yaml name the registration function by this module's path (the proxy imports it).
__all__ = ["GrpcIngress", "add_slimserve_grpc_servicers"]

log = logging.getLogger(__name__)
GENERATION_SERVICE = "slimserve.v1.Generation"
HEALTH_TIMEOUT_S = 3.0
STATS_TIMEOUT_S = 1.0
WATCH_PERIOD_S = 5.0
_SERVING = health_pb2.HealthCheckResponse


Reply = TypeVar("Reply", bound=Message)
UnaryMethod = Callable[[Any, Any, RayServegRPCContext], Awaitable[Reply]]


class GrpcRequestError(Exception):
    """Raised after the gRPC context carries the status code the caller should get."""


def unary_rpc(reply: type[Reply]) -> Callable[[UnaryMethod], UnaryMethod]:
    """A unary RPC whose every failure becomes a status code on the context.

    The method then returns an empty `reply` rather than raising, so that trailers (the
    retry delay) reach the client through Serve's proxy. Serve passes `grpc_context` by
    keyword, and finds that it may by the wrapped method's signature (functools.wraps)."""

    def wrap(method: UnaryMethod) -> UnaryMethod:
        @functools.wraps(method)
        async def rpc(self: GrpcIngress, request: Any, grpc_context: RayServegRPCContext):
            try:
                return await method(self, request, grpc_context)
            except Exception as e:  # noqa: BLE001 - every failure becomes a status code
                self._grpc_fail(grpc_context, self._grpc_status(e))
                return reply()

        return rpc

    return wrap


class GrpcIngress:
    """gRPC methods of the Ingress deployment (mixed into app.serve.ingress.Ingress)."""

    # Set by Ingress.__init__; everything the gRPC methods use of the ingress.
    args: ServeArgs
    model_name: str
    tokenizer: Any
    normalizer: RequestNormalizer
    driver: RequestDriver
    _grpc_streams = 0  # Generate calls running on this replica

    def grpc_streams_open(self) -> int:
        """Generate calls still streaming here. A client's cancel that Serve's gRPC proxy
        did not pass on leaves its call streaming (open defect, docs/reliability.md); one
        that reached this replica ends the call: tests tell the two apart with this."""
        return self._grpc_streams

    # --- slimserve.v1.Generation ------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        stream: ChoiceStream | None = None
        self._grpc_streams += 1
        try:
            rid, stream, counter, tools, timeout_s = await self._grpc_start(request, grpc_context)
            calls = StreamToolCalls(tools) if tools is not None and tools.constrained else None
            end = time.monotonic() + timeout_s
            delta = await _next(stream.first(), end)  # every choice admitted: no 200-then-429
            while delta is not None:
                message = stream_message(delta, rid, calls)
                if counter.add(delta):
                    message.usage.CopyFrom(counter.usage())
                yield message
                delta = await _next(stream.next(), end)
        except Exception as e:  # noqa: BLE001 - every failure becomes a status code
            # A streaming error's trailers cannot reach the client through Serve's proxy
            # (only code and details do), so the retry delay is in the details too.
            raise self._grpc_fail(grpc_context, self._grpc_status(e)) from e
        finally:
            self._grpc_streams -= 1
            if stream is not None:
                stream.close()  # cancelled or failed: the engines abort, blocks are freed

    @unary_rpc(pb.CompleteResponse)
    async def Complete(
        self, request: pb.GenerateRequest, grpc_context: RayServegRPCContext
    ) -> pb.CompleteResponse:
        rid, stream, counter, tools, timeout_s = await self._grpc_start(request, grpc_context)
        per_choice = await stream.collect(timeout_s=timeout_s)
        return complete_message(rid, self.model_name, per_choice, counter, tools)

    @unary_rpc(pb.TokenizeResponse)
    async def Tokenize(
        self, request: pb.TokenizeRequest, grpc_context: RayServegRPCContext
    ) -> pb.TokenizeResponse:
        request = self._grpc_admit(request, grpc_context, model=True)
        info = await self.driver.describe()
        kind = request.WhichOneof("input")
        if kind == "chat":
            turns = conversation(request.chat)
            ids = await asyncio.to_thread(self.tokenizer.encode_chat, turns)
        elif kind == "text":
            ids = await asyncio.to_thread(self.tokenizer.encode, request.text)
        else:
            raise APIError(400, "input: set exactly one of text or chat")
        return pb.TokenizeResponse(token_ids=ids, max_model_len=info.max_model_len)

    @unary_rpc(pb.DetokenizeResponse)
    async def Detokenize(
        self, request: pb.DetokenizeRequest, grpc_context: RayServegRPCContext
    ) -> pb.DetokenizeResponse:
        request = self._grpc_admit(request, grpc_context, model=True)
        vocab = (await self.driver.describe()).vocab_size
        ids = list(request.token_ids)
        if any(t >= vocab for t in ids):
            raise APIError(400, f"token_ids: every id must be in [0, {vocab})")
        text = self.tokenizer.decode(ids, skip_special_tokens=not request.keep_special_tokens)
        return pb.DetokenizeResponse(text=text)

    @unary_rpc(pb.ListModelsResponse)
    async def ListModels(
        self, request: pb.ListModelsRequest, grpc_context: RayServegRPCContext
    ) -> pb.ListModelsResponse:
        self._grpc_admit(request, grpc_context, model=False)  # no model field
        info = await self.driver.describe()
        model = pb.Model(
            id=self.model_name,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            kv_cache_dtype=info.kv_cache_dtype,  # what the replicas use, never "auto"
        )
        return pb.ListModelsResponse(models=[model])

    async def Health(
        self, request: pb.HealthRequest, grpc_context: RayServegRPCContext
    ) -> pb.HealthResponse:
        if not await self._grpc_engines_running():
            return pb.HealthResponse(status=pb.HealthResponse.STATUS_NOT_SERVING)
        stats = await self._grpc_replica_stats()  # best effort: a saturated replica may not answer
        return pb.HealthResponse(
            status=pb.HealthResponse.STATUS_SERVING,
            kv_blocks_free=int(stats.get("kv_blocks_free", 0)),
            kv_blocks_total=int(stats.get("kv_blocks_total", 0)),
            num_running=int(stats.get("num_running", 0)),
            num_waiting=int(stats.get("num_waiting", 0)),
        )

    # --- grpc.health.v1.Health ----------------------------------------------------------
    async def Check(
        self, request: health_pb2.HealthCheckRequest, grpc_context: RayServegRPCContext
    ) -> health_pb2.HealthCheckResponse:
        service = getattr(request, "service", None)  # None: a MalformedRequest
        if service not in ("", GENERATION_SERVICE):
            error = GrpcError(grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}")
            self._grpc_fail(grpc_context, error)
            return _SERVING()
        return _SERVING(status=await self._grpc_serving_status())

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, grpc_context: RayServegRPCContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if getattr(request, "service", None) not in ("", GENERATION_SERVICE):
            yield _SERVING(status=_SERVING.SERVICE_UNKNOWN)
            return
        last = None
        while True:  # until the client goes away (its cancel ends this generator)
            status = await self._grpc_serving_status()
            if status != last:
                yield _SERVING(status=status)
                last = status
            await asyncio.sleep(WATCH_PERIOD_S)

    # --- shared -------------------------------------------------------------------------
    async def _grpc_start(
        self, request: pb.GenerateRequest, ctx: RayServegRPCContext
    ) -> tuple[str, ChoiceStream, UsageCounter, ToolChoice | None, float]:
        """Validate and start one request's choices (the shared path of both APIs); the
        last item is the call's time limit in seconds."""
        request = parsed(request)
        timeout_s = call_timeout_s(request, self.args.request_timeout_s)
        metadata = dict(ctx.invocation_metadata())
        require = self.args.grpc_require_api_key
        self.normalizer.tenant_salt(metadata, require_key=require)  # auth before anything
        body = http_body(request, self.model_name)
        rid = request_id(request, "grpc-" + uuid.uuid4().hex)
        req = await self.normalizer.normalize(body, metadata, request_id=rid, require_key=require)
        stream = await self.driver.start(req)
        counter = UsageCounter(len(req.prompt_token_ids), req.params.n)
        return rid, stream, counter, req.tools, timeout_s

    def _grpc_admit(self, request: Reply, ctx: RayServegRPCContext, *, model: bool) -> Reply:
        """The parsed request of a caller with a known key, for the served model if `model`
        (INVALID_ARGUMENT when the proxy could not parse it; UNAUTHENTICATED when a key is
        required and not known; NOT_FOUND for another model)."""
        request = parsed(request)
        metadata = dict(ctx.invocation_metadata())
        self.normalizer.tenant_salt(metadata, require_key=self.args.grpc_require_api_key)
        if model:
            self.normalizer.check_model(request.model)
        return request

    def _grpc_fail(self, ctx: RayServegRPCContext, error: GrpcError) -> GrpcRequestError:
        ctx.set_code(error.code)
        ctx.set_details(error.message)
        if error.trailers:
            ctx.set_trailing_metadata(list(error.trailers))
        return GrpcRequestError(error.message)

    def _grpc_status(self, e: Exception) -> GrpcError:
        error = grpc_error(e, self.args.retry_after_s)
        if error.code == grpc.StatusCode.INTERNAL:  # our fault: keep the traceback
            log.error("gRPC request failed", exc_info=e)
        return error

    async def _grpc_engines_running(self) -> bool:
        """Serve's own view: every engine deployment has a RUNNING replica.

        Asked of the controller rather than of the replicas, so that a saturated replica
        (whose request queue is full) still counts as healthy.
        """
        names = [h.deployment_name for h in self.driver.handles]
        try:
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), HEALTH_TIMEOUT_S)
            app = status.applications[serve.get_replica_context().app_name]
        except Exception:  # noqa: BLE001 - no answer means not serving
            return False
        for name in names:
            deployment = app.deployments.get(name)
            if deployment is None or not deployment.replica_states.get("RUNNING", 0):
                return False
        return True

    async def _grpc_replica_stats(self) -> dict[str, Any]:
        """The generating replica's engine stats, or {} if it does not answer in time."""
        response = self.driver.generating.stats.remote()
        try:
            return await asyncio.wait_for(_result(response), STATS_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            response.cancel()
            return {}

    async def _grpc_serving_status(self) -> int:
        ok = await self._grpc_engines_running()
        return _SERVING.SERVING if ok else _SERVING.NOT_SERVING


async def _result(response) -> Any:
    return await response


async def _next(step, end: float):
    """`step` (a ChoiceStream read), bounded by the request's deadline.

    `asyncio.timeout`, not `wait_for`: on Python 3.11 `wait_for` swallows a cancel that lands
    as the read completes, and the stream then ran on to its end with nobody listening
    (a client's deadline did not abort; docs/reliability.md)."""
    remaining = end - time.monotonic()
    if remaining <= 0:
        step.close()
        raise TimeoutError("the request ran past its timeout_s (or the server's request_timeout_s)")
    try:
        async with asyncio.timeout(remaining):
            return await step
    except TimeoutError:
        raise TimeoutError(
            "the request ran past its timeout_s (or the server's request_timeout_s)"
        ) from None
