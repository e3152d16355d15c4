"""What every engine-owning deployment shares: construction, health and reported stats."""

from __future__ import annotations

from typing import Any

from app.kvstore.store import KVStoreClient
from app.serve.config import ServeArgs
from app.serve.replica import EngineHost


class EngineReplica:
    """Base of PrefillServer, DecodeServer and EngineServer (Serve calls these hooks)."""

    role = "colocated"
    uses_store = False  # the colocated baseline keeps only its local prefix cache

    def __init__(self, args: dict[str, Any]):
        self.args = ServeArgs(**args)
        store = None
        if self.uses_store:
            a = self.args
            store = KVStoreClient.from_name(a.store_name, a.store_shards, a.store_capacity_bytes)
        self.host = EngineHost(self.args, store, role=self.role)

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
