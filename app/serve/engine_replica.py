"""What every engine-owning deployment shares: construction, health and reported stats."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from ray import serve

from app.engine.engine import Engine
from app.engine.request import Request
from app.engine.sampling_params import SamplingParams
from app.kvstore.handoff import HandOffs
from app.kvstore.store import KVStoreClient
from app.serve.call_port import CallPort
from app.serve.config import ServeArgs
from app.serve.delta_outbox import DeltaOutbox
from app.serve.replica import EngineHost, node_ip
from app.serve.slots import Slots

log = logging.getLogger(__name__)
# Direct calls still running when the replica stops get this long to end (Serve's default
# graceful_shutdown_timeout_s is 20 s; the replica is killed after it in any case).
DRAIN_S = 15.0


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
        self.slots = replica_slots(self.args)  # shared by Serve and direct calls
        self.calls = self._call_port()  # direct calls from the ingresses, or None
        warm_up(self.host.engine)

    def _call_port(self) -> CallPort | None:
        """The direct call channel's port (`call_channel: socket`); Serve runs this
        constructor on the replica's event loop, where the port then serves."""
        a = self.args
        if a.call_channel != "socket" or a.delta_channel != "socket":
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # constructed outside an event loop (unit tests): no port
            return None
        port = CallPort(self, node_ip(), self.slots)
        self._port_start = loop.create_task(port.start())  # kept: a task must be referenced
        return port

    async def describe(self) -> dict[str, Any]:
        return {**self.host.describe(), "replica": self.host.name}

    def check_health(self) -> None:
        self.host.check_health()

    def __del__(self) -> Coroutine[Any, Any, None] | None:
        """Serve calls this when the replica stops, after its own calls drained, and awaits
        what it returns: direct calls, which Serve does not count, get the same grace.
        (Not `async def`: the garbage collector calls `__del__` too, and must not be left
        with a coroutine nobody awaits; by then the port has stopped.)"""
        calls = getattr(self, "calls", None)
        if calls is not None and calls.serving:
            return calls.drain(DRAIN_S)
        return None

    def record_routing_stats(self) -> dict[str, Any]:
        stats = self.host.routing_stats()
        if self.calls is not None and self.calls.serving:  # where ingresses place calls
            stats["call_port"] = self.calls.address.to_stats()
        return stats

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.host.autoscaling_stats()

    async def stats(self) -> dict[str, Any]:
        direct = {"direct_calls": self.calls.calls} if self.calls is not None else {}
        return {**self.host.stats(), **direct, "slots_in_use": self.slots.in_use}


def replica_slots(args: ServeArgs) -> Slots:
    """The replica's slots, sized by `max_ongoing` at each take and release."""
    return Slots(functools.partial(max_ongoing, args))


def max_ongoing(args: ServeArgs) -> int:
    """This deployment's `max_ongoing_requests` as Serve runs it now: an operator's config may
    set it apart from the app's args (deploy/gpu.yaml: 128 prefill, 256 decode), and change it
    in place later (Serve's reconfigure updates the replica context); slots sized from the
    args would hold Serve's calls back in the replica. (A private field of Serve's replica
    context, hence the fallback to the args: the value the app deploys with.)"""
    try:
        return int(serve.get_replica_context()._deployment_config.max_ongoing_requests)
    except Exception:  # noqa: BLE001 - outside a replica (unit tests), or Serve changed
        return args.max_ongoing_requests


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
