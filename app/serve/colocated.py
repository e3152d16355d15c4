"""EngineServer: one deployment doing prefill and decode (the baseline for disaggregation)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from app.engine.request import Request, RequestDelta
from app.serve.config import ServeArgs
from app.serve.messages import GenerateRequest
from app.serve.replica import EngineHost


@serve.deployment(name="EngineServer")
class EngineServer:
    def __init__(self, args: dict[str, Any]):
        self.args = ServeArgs(**args)
        self.host = EngineHost(self.args, store=None)  # local prefix cache only

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
            async for delta in host.async_engine.generate(request):
                yield delta
        finally:
            host.inflight_tokens -= len(req.prompt_token_ids)
