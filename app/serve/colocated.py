"""EngineServer: one deployment doing prefill and decode (the baseline for disaggregation)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

from ray import serve

from app.engine.request import Request, RequestDelta
from app.serve.engine_replica import EngineReplica
from app.serve.messages import GenerateRequest
from app.serve.streaming import coalesce


@serve.deployment(name="EngineServer")
class EngineServer(EngineReplica):
    role = "colocated"

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        host = self.host
        host.inflight_tokens += len(req.prompt_token_ids)
        try:
            request = Request(
                req.request_id,
                req.prompt_token_ids,
                dataclasses.replace(req.params, n=1),
                cache_salt=req.cache_salt,
            )
            deltas = host.async_engine.generate(request)
            # Closed explicitly: when Serve closes or drops this generator (a cancelled
            # caller), the engine aborts now, not whenever the garbage collector runs.
            async with contextlib.aclosing(coalesce(deltas, self.args.stream_interval_s)) as s:
                async for delta in s:
                    yield delta
        finally:
            host.inflight_tokens -= len(req.prompt_token_ids)
