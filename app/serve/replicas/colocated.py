"""EngineServer: one deployment doing prefill and decode (the baseline for disaggregation)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ray import serve

from app.engine.request import RequestDelta
from app.serve.channel.delta_outbox import stream_to
from app.serve.channel.delta_wire import ReplyTo, StreamSummary
from app.serve.messages import GenerateRequest
from app.serve.replicas.engine_replica import EngineReplica
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

    async def generate_to(
        self, req: GenerateRequest, reply_to: ReplyTo, claim: bytes
    ) -> StreamSummary:
        """Sends the deltas to the ingress's inbox (`delta_channel: socket`: one frame per
        engine step for all of that ingress's requests); returns once the final delta is on
        the wire. Serve counts the call as ongoing until then (its autoscaler sees it);
        cancelling it aborts the engine request at once. ``claim``: what binds the request
        id to this replica's connection at the inbox."""
        host = self.host
        link = await self.outbox.link(reply_to)
        link.claim(req.request_id, claim)
        tokens = 0

        def on_delta(delta: RequestDelta) -> None:
            nonlocal tokens
            tokens += len(delta.new_token_ids)
            link.send(delta)

        host.inflight_tokens += len(req.prompt_token_ids)
        try:
            await stream_to(link, host.async_engine.run(req.engine_request(), on_delta))
        finally:
            host.inflight_tokens -= len(req.prompt_token_ids)
        return StreamSummary(req.request_id, tokens)
