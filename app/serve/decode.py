"""DecodeServer: fetch the prompt's KV (verified), continue from the first token, stream."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from app.engine.request import Request, RequestDelta
from app.kvstore.store import KVStoreClient
from app.serve.config import ServeArgs
from app.serve.messages import DecodeRequest
from app.serve.replica import EngineHost

log = logging.getLogger(__name__)


@serve.deployment(name="DecodeServer")
class DecodeServer:
    def __init__(self, args: dict[str, Any]):
        self.args = ServeArgs(**args)
        store = KVStoreClient.from_name(self.args.store_name, self.args.store_shards)
        self.host = EngineHost(self.args, store, role="decode")

    async def describe(self) -> dict[str, Any]:
        return {**self.host.describe(), "replica": self.host.name}

    def check_health(self) -> None:
        self.host.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.host.routing_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.host.autoscaling_stats()

    async def stats(self) -> dict[str, Any]:
        return self.host.stats()

    async def generate(self, req: DecodeRequest) -> AsyncIterator[RequestDelta]:
        """Deltas after the first token. If the prompt's KV cannot be fetched or verified,
        the engine recomputes what is missing: the tokens are the same either way."""
        gen, first = req.request, req.prefill.first
        prompt = gen.prompt_token_ids
        host = self.host
        host.inflight_tokens += len(prompt)
        try:
            fetched = await host.fetch(req.prefill.chunks, prompt)
            params = gen.params
            request = Request(
                gen.request_id,
                prompt + first.new_token_ids,
                dataclasses.replace(
                    params, n=1, max_tokens=params.max_tokens - len(first.new_token_ids)
                ),
                cache_salt=gen.cache_salt,
                kv_import=fetched.chunks or None,
            )
            deltas = host.async_engine.generate(request)
            # timed: inter-token latency on this replica (the first token came from prefill)
            async for delta in host.metrics.timed(
                deltas, len(prompt), count=False, after_first_token=True
            ):
                yield dataclasses.replace(delta, num_prompt_tokens=len(prompt))
        finally:
            host.inflight_tokens -= len(prompt)
