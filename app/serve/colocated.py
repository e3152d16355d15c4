"""EngineServer: one deployment doing prefill and decode (the baseline for disaggregation)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ray import serve

from app.engine.request import RequestDelta
from app.serve.engine_replica import EngineReplica
from app.serve.messages import GenerateRequest
from app.serve.streaming import coalesce


@serve.deployment(name="EngineServer")
class EngineServer(EngineReplica):
    role = "colocated"

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RequestDelta]:
        """Streams the choice's deltas back through Serve."""
        host = self.host
        host.inflight_tokens += len(req.prompt_token_ids)
        try:
            deltas = host.async_engine.generate(req.engine_request())
            # Closed explicitly: when Serve closes or drops this generator (a cancelled
            # caller), the engine aborts now, not whenever the garbage collector runs.
            async with contextlib.aclosing(coalesce(deltas, self.args.stream_interval_s)) as s:
                async for delta in s:
                    yield delta
        finally:
            host.inflight_tokens -= len(req.prompt_token_ids)
