"""What every engine-owning deployment shares: construction, health and reported stats."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any

from app.engine.engine import Engine
from app.engine.request import Request
from app.engine.sampling_params import SamplingParams
from app.kvstore.handoff import HandOffs
from app.kvstore.store import KVStoreClient
from app.serve.channel.delta_outbox import DeltaOutbox
from app.serve.config import ServeArgs
from app.serve.replicas.replica import EngineHost

log = logging.getLogger(__name__)


class EngineReplica:
    """Base of PrefillServer, DecodeServer and EngineServer (Serve calls these hooks)."""

    role = "colocated"
    uses_store = False  # the colocated baseline keeps only its local prefix cache

    def __init__(self, args: dict[str, Any]):
        self.args = ServeArgs(**args)
        store, a = None, self.args
        self.hand_offs: HandOffs | None = None  # prefill -> decode results (disaggregated)
        if self.uses_store:
            store = KVStoreClient.from_name(a.store_name, a.store_shards, a.store_capacity_bytes)
            self.hand_offs = HandOffs(a.store_name)
        self.host = EngineHost(self.args, store, role=self.role)
        self.outbox = DeltaOutbox()  # the delta channel's links to the ingresses
        warm_up(self.host.engine)

    async def describe(self) -> dict[str, Any]:
        return {**self.host.describe(), "replica": self.host.name}

    def check_health(self) -> None:
        self.host.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.host.routing_stats()

    def placement_load(self) -> dict[str, Any]:
        """Broadcast by each ingress every routing period (app/serve/routing/load_view.py)."""
        return self.host.placement_load()

    def tell_spilled_demand(self, tokens: int) -> None:
        """The decode replicas' whole spilled prefill demand, told to a prefill replica by
        each ingress every routing period (app/serve/routing/load_view.py)."""
        self.host.spilled_demand.tell(tokens)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.host.autoscaling_stats()

    async def stats(self) -> dict[str, Any]:
        return self.host.stats()


def warm_up(engine: Engine, prompt_len: int = 33) -> float:
    """One short request (prefill + one decode step) before the replica takes traffic: the
    first forward passes pay one-off costs (kernel and allocator set-up, lazy imports) that
    otherwise land on the first user's TTFT (measured 2.7x the steady TTFT before this).
    Its cache salt is private, so no request can hit its blocks, and the prefix-cache
    counters are restored after it (they count user traffic). Returns its seconds."""
    start = time.perf_counter()
    stats = dataclasses.replace(engine.blocks.stats)
    tag = f"warmup-{uuid.uuid4().hex}"
    n = max(1, min(prompt_len, engine.model_config.max_position_embeddings - 3))
    vocab = engine.model_config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request(Request(tag, prompt, params, cache_salt=tag))
    while engine.has_unfinished():
        engine.step()
    engine.blocks.stats = stats
    seconds = time.perf_counter() - start
    log.info("engine warmed up in %.3fs", seconds)
    return seconds
