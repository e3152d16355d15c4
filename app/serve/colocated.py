"""EngineServer: one deployment doing prefill and decode (the baseline for disaggregation)."""

from __future__ import annotations

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
            async for delta in coalesce(deltas, self.args.stream_interval_s):
                yield delta
        finally:
            host.inflight_tokens -= len(req.prompt_token_ids)
