"""What every engine replica shares: the engine, its chunk keys, store I/O, routing stats."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any

import ray
import torch

from app.config import EngineConfig
from app.engine.async_engine import AsyncEngine
from app.engine.engine import Engine
from app.engine.step_threads import StepThreads
from app.kv.chunk import KVChunk
from app.kvstore.store import KVStoreClient, StoredChunk
from app.kvstore.transfer import FetchResult, drop_rejected, fetch_verified
from app.serve.config import EngineArgs, ServeArgs
from app.serve.messages import prompt_chunk_keys, short_key
from app.serve.metrics import ReplicaMetrics, model_label
from app.serve.routing.autoscaling import SpilledDemand, autoscaling_stats
from app.serve.routing.compute import Compute, this_replica
from app.serve.routing.prefill_placement import (
    DECODE_HEADROOM_TOKENS,
    DECODE_STEP_SECONDS,
    PREFILL_QUEUE_TOKENS,
    PREFILL_RATE,
)

log = logging.getLogger(__name__)
_RECENT_KEYS = 2048  # chunk keys a replica advertises for prefix affinity


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from app.assets import default_model_path

    return default_model_path()


def engine_config(args: EngineArgs) -> EngineConfig:
    return args.engine_config(resolve_model(args.model))


def replica_name() -> str:
    try:
        return ray.get_runtime_context().get_actor_name() or f"pid-{os.getpid()}"
    except Exception:  # outside an actor (unit tests)
        return f"pid-{os.getpid()}"


class EngineHost:
    def __init__(self, args: ServeArgs, store: KVStoreClient | None, role: str = "colocated"):
        threads = args.engine.step_threads()
        if threads:
            torch.set_num_threads(threads)
        self.args = args
        self.name = replica_name()
        self.engine = self._start_engine(engine_config(args.engine))
        if threads:
            min_tokens = args.engine.threaded_step_min_tokens
            self.engine.step_threads = StepThreads(threads, min_tokens)
        self.async_engine = AsyncEngine(self.engine)
        self.store = store
        spec = self.engine.kv_spec
        self.chunk_tokens = args.engine.chunk_tokens
        self.block_size = spec.block_size
        self.expect = self.engine.chunk_format  # what fetched chunks must match
        self.inflight_tokens = 0  # prompt tokens of requests this replica is working on
        # decode: prompt tokens of choices it prefills itself, until their first token
        self.local_prefill_tokens = 0
        # ... of them, the tokens taken from busy prefill replicas (DecodeRequest)
        self.spilled_prefill_tokens = 0
        # prefill: the decode replicas' spilled tokens, told by the ingresses
        self.spilled_demand = SpilledDemand.for_period(args.routing_stats_period_s)
        self.role = role
        self._recent: OrderedDict[int, None] = OrderedDict()
        model = model_label(args.served_model_name, self.engine.config.model)
        self.metrics = ReplicaMetrics(role, model)  # app/serve/metrics.py
        self.compute = _compute(self.engine.config, threads or torch.get_num_threads())

    def _start_engine(self, config: EngineConfig) -> Engine:
        if config.tensor_parallel_size == 1:
            return Engine(config)
        from app.serve.replicas.tp_workers import start_ray_tp_group

        group = start_ray_tp_group(
            config, self.args.replica_num_cpus, self.args.replica_num_gpus, self.name
        )
        return Engine(config, tp_group=group)

    def check_health(self) -> None:
        """Raises when a tensor-parallel worker rank died: Serve then replaces the replica."""
        if self.engine.tp_group is not None:
            self.engine.tp_group.check()

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to tokenize, validate and key prompts like the engine."""
        cfg = self.engine.model_config
        return {
            "model": self.engine.config.model,
            "fingerprint": self.engine.fingerprint,
            "salt_base": list(self.engine.salt_base),
            "block_size": self.block_size,
            "chunk_tokens": self.chunk_tokens,
            "max_model_len": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size,
            "eos_token_ids": sorted(self.engine.outputs.eos_ids),
            "kv_cache_dtype": self.engine.kv_spec.dtype.name,  # resolved: never "auto"
        }

    def chunk_keys(self, prompt: list[int], cache_salt: str | None) -> list[bytes]:
        return prompt_chunk_keys(
            prompt, self.engine.salt_base, cache_salt, self.block_size, self.chunk_tokens
        )

    async def import_from_store(
        self, prompt: list[int], cache_salt: str | None
    ) -> tuple[FetchResult, list[StoredChunk]]:
        """The verified KV of the prompt's longest stored prefix (leaving >= 1 token to run)."""
        if self.store is None:
            return FetchResult(), []
        usable = (len(prompt) - 1) // self.chunk_tokens
        keys = self.chunk_keys(prompt, cache_salt)[:usable]
        local = self.locally_cached_chunks(keys)
        if local == len(keys):
            return FetchResult(), []  # the local prefix cache has all the store could give
        hit = await self.store.match_prefix(keys)
        asked = (len(keys) - local) * self.chunk_tokens  # store queries: what local lacks
        if len(hit) <= local:  # nothing to fetch; the refs still save re-publishing
            self.metrics.on_store_lookup(asked, 0)
            return FetchResult(), hit
        fetched = await self.fetch(hit, prompt)
        self.metrics.on_store_lookup(asked, max(0, fetched.num_tokens - local * self.chunk_tokens))
        return fetched, hit[: len(fetched.chunks)]

    def locally_cached_chunks(self, keys: list[bytes]) -> int:
        """Leading chunks whose last block is in the engine's prefix cache (a chunk key is
        its last block's key). Advisory: blocks may be evicted before the request runs."""
        cached = self.engine.blocks.cached  # membership tests are safe beside the step thread
        run = 0
        while run < len(keys) and keys[run] in cached:
            run += 1
        return run

    async def fetch(
        self, stored: list[StoredChunk], prompt: list[int], verify_tag: bool = True, start: int = 0
    ) -> FetchResult:
        """verify_tag=False: the engine's import checks the tags (drop_rejected after);
        start: the prompt position of the first chunk."""
        assert self.store is not None
        result = await fetch_verified(
            self.store, stored, self.expect, prompt, verify_tag=verify_tag, start=start
        )
        self.metrics.on_chunks("fetch", result.bytes)
        self.metrics.on_chunk_failures(result.failures)
        self.remember(c.key for c in result.chunks if c.key)
        return result

    async def drop_rejected(self, rejected: list[tuple[bytes, str]]) -> None:
        """Imported chunks whose tag the engine rejected (it recomputed their KV)."""
        assert self.store is not None
        await drop_rejected(self.store, rejected)
        self.metrics.on_chunk_failures([(key, "integrity", msg) for key, msg in rejected])

    def remember(self, keys) -> None:
        for key in keys:
            self._recent[short_key(key)] = None
            self._recent.move_to_end(short_key(key))
        while len(self._recent) > _RECENT_KEYS:
            self._recent.popitem(last=False)

    def routing_stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        self.metrics.on_step(s, self.block_size)  # Serve calls this every routing period
        self._export_placement_load(s)
        used_blocks = s["kv_blocks_total"] - s["kv_blocks_free"]
        return {
            "inflight_tokens": self.inflight_tokens,
            "kv_tokens_held": int(used_blocks * self.block_size),
            "free_blocks": int(s["kv_blocks_free"]),
            "block_size": self.block_size,
            "cached_keys": list(self._recent),
        }

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "inflight_tokens": self.inflight_tokens, "name": self.name}

    def _export_placement_load(self, stats: dict[str, Any]) -> None:
        """The prefill placement's inputs as this replica reports them (the ingress reads
        the same through `placement_load`): its measured prefill rate, a prefill replica's
        queued prompt tokens, a decode (or colocated) replica's KV headroom and decode step
        time."""
        load = self.placement_load(stats)
        self.metrics.set(PREFILL_RATE, load["prefill_rate"] or 0.0)  # 0: not measured yet
        if self.role == "prefill":
            self.metrics.set(PREFILL_QUEUE_TOKENS, load["queued_prefill_tokens"])
        else:
            headroom = load["free_kv_tokens"] - load["queued_prefill_tokens"]
            self.metrics.set(DECODE_HEADROOM_TOKENS, headroom)
            self.metrics.set(DECODE_STEP_SECONDS, load["decode_step_s"] or 0.0)

    def placement_load(self, stats: dict[str, Any] | None = None) -> dict[str, Any]:
        """What the ingress's prefill placement policy reads (app/serve/routing/load_view.py): the
        prompt tokens still to prefill here (a prefill replica: every prompt in flight; a
        decode replica: the prompts it was given to prefill, until their first token), its
        free KV tokens, its running batch, where it computes, and its measured prefill rate
        and decode step time. ``stats``: `Engine.stats()` if already read."""
        s = stats if stats is not None else self.engine.stats()
        queued = self.inflight_tokens if self.role == "prefill" else self.local_prefill_tokens
        rates = self.engine.step_rates  # measured from its own steps (None: not yet)
        return {
            "queued_prefill_tokens": queued,
            "free_kv_tokens": int(s["kv_blocks_free"]) * self.block_size,
            "num_running": int(s["num_running"]),
            "compute": self.compute.report() if self.compute else None,
            "prefill_rate": rates.prefill_tokens_per_s,
            "decode_step_s": rates.decode_step_s,
            "spilled_prefill_tokens": self.spilled_prefill_tokens,
        }

    def autoscaling_stats(self) -> dict[str, float]:
        """The load Serve's autoscaler sees (app/serve/routing/autoscaling.py)."""
        spilled = self.spilled_demand.tokens if self.role == "prefill" else 0
        return autoscaling_stats(self.engine.stats(), self.inflight_tokens, spilled)


def _compute(config: EngineConfig, threads: int) -> Compute | None:
    """Where this replica computes; None (never shared) for a tensor-parallel group, whose
    compute is its workers' (app/serve/replicas/tp_workers.py), and outside Ray."""
    if config.tensor_parallel_size > 1 or not ray.is_initialized():
        return None
    return this_replica(threads)


def is_full(chunk: KVChunk, chunk_tokens: int) -> bool:
    return chunk.meta.num_tokens == chunk_tokens
