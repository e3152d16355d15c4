"""build_app(args) -> serve.Application: the deployment graph for either mode.

disaggregated: Ingress -> PrefillServer (xN) -> DecodeServer (xM), with the KV store shards
as detached named actors; colocated: Ingress -> EngineServer (xN).
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from app.kvstore.handoff import start_box
from app.kvstore.store import create_store
from app.serve.config import ServeArgs
from app.serve.ingress import Ingress
from app.serve.replicas.colocated import EngineServer
from app.serve.replicas.decode import DecodeServer
from app.serve.replicas.prefill import PrefillServer
from app.serve.routing.router import TokenAwareRouter


def build_app(args: dict[str, Any] | ServeArgs) -> serve.Application:
    """Entry point for `serve run app.serve.build:build_app` and `slimserve serve`."""
    cfg = args if isinstance(args, ServeArgs) else ServeArgs(**(args or {}))
    plain = cfg.model_dump()
    ingress = Ingress.options(
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=cfg.max_ongoing_requests * 4,
    )
    if cfg.mode == "colocated":
        engine = _engine_deployment(EngineServer, cfg, cfg.num_engine_replicas, "prefill")
        return ingress.bind(plain, engine=engine.bind(plain))
    ensure_store(cfg)
    prefill = _engine_deployment(PrefillServer, cfg, cfg.num_prefill_replicas, "prefill")
    decode = _engine_deployment(DecodeServer, cfg, cfg.num_decode_replicas, "decode")
    return ingress.bind(plain, prefill=prefill.bind(plain), decode=decode.bind(plain))


def _engine_deployment(cls, cfg: ServeArgs, replicas: int, role: str):
    router = RequestRouterConfig(
        request_router_class=TokenAwareRouter,
        request_router_kwargs={
            "role": role,
            "chunk_tokens": cfg.engine.chunk_tokens,
        },
        request_routing_stats_period_s=cfg.routing_stats_period_s,
    )
    return cls.options(
        num_replicas=replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests,
        ray_actor_options={"num_cpus": cfg.replica_num_cpus, "num_gpus": cfg.replica_num_gpus},
        request_router_config=router,
        health_check_period_s=5,
        **_tp_options(cfg),
    )


def _tp_options(cfg: ServeArgs) -> dict[str, Any]:
    """A TP replica reserves one bundle per rank on one node; it runs in bundle 0."""
    tp = cfg.engine.tensor_parallel_size
    if tp == 1:
        return {}
    from app.serve.replicas.tp_workers import tp_bundles

    bundles = tp_bundles(tp, cfg.replica_num_cpus, cfg.replica_num_gpus)
    return {"placement_group_bundles": bundles, "placement_group_strategy": "STRICT_PACK"}


def ensure_store(cfg: ServeArgs) -> None:
    """Start the store shards and their hand-off box once per cluster (detached, named);
    later calls reuse them."""
    if not ray.is_initialized():
        ray.init()
    create_store(
        cfg.store_capacity_bytes, cfg.store_shards, name=cfg.store_name, lifetime="detached"
    )
    start_box(cfg.store_name)  # prefill -> decode hand-offs (app/kvstore/handoff.py)
