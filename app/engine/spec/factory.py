"""Builds the engine's Speculator for a SpeculativeConfig (one place per method)."""

from __future__ import annotations

from dataclasses import replace

from app.config import SpeculativeConfig
from app.engine.kv_cache import KVCache
from app.engine.spec.speculator import Speculator


def uses_mtp(config: SpeculativeConfig | None) -> bool:
    return config is not None and config.method == "mtp"


def extra_kv_layers(config: SpeculativeConfig | None) -> int:
    """KV layers a proposer adds per block (MTP: its one layer)."""
    return 1 if uses_mtp(config) else 0


def make_speculator(engine, ops) -> Speculator:
    config = engine.config.speculative_config
    max_len = engine.model_config.max_position_embeddings
    if config.method == "ngram":
        return Speculator(config, engine.blocks, max_len)
    if config.method == "mtp":
        return Speculator(config, engine.blocks, max_len, _mtp_drafter(engine, ops))
    raise ValueError(f"speculative method {config.method!r} is not available yet")


def _mtp_drafter(engine, ops):
    from app.engine.spec.mtp import MTPProposer

    if engine.tp_group is not None:
        raise ValueError("mtp speculation with tensor_parallel_size > 1 is not supported yet")
    spec = replace(engine.kv_spec, num_layers=1)
    cache = KVCache(spec, engine.blocks.num_blocks, engine.device)
    engine.runner.keep_hidden = True
    return MTPProposer(engine.model, cache, ops, engine.runner.scale, engine.blocks, engine.device)
