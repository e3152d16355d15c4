"""Builds the engine's Speculator for a SpeculativeConfig (one place per method)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

from app.config import ModelConfig, SpeculativeConfig
from app.engine.kv_cache import KVCache
from app.engine.spec.speculator import Speculator
from app.kv.layout import KVCacheSpec
from app.models.loader import build_model


def uses_mtp(config: SpeculativeConfig | None) -> bool:
    return config is not None and config.method == "mtp"


def extra_block_bytes(engine) -> int:
    """Bytes a proposer's own KV adds to every block (its cache shares the block ids)."""
    config = engine.config.speculative_config
    if config is None or config.method == "ngram":
        return 0
    return _proposer_kv_spec(engine).bytes_per_block()


def _proposer_kv_spec(engine) -> KVCacheSpec:
    config = engine.config.speculative_config
    if config.method == "mtp":  # one more layer shaped like the target's
        return replace(engine.kv_spec, num_layers=1)
    cfg = ModelConfig.from_path(config.model)  # draft model, unsharded
    bs, dtype = engine.kv_spec.block_size, engine.kv_spec.dtype
    # The family's own cache shape (MLA) from its hook, on a weightless (meta) build.
    own = build_model(cfg, engine.dtype, "meta").kv_cache_spec(bs, dtype)
    if own is not None:
        return own
    return KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, bs, dtype)


def make_speculator(engine, ops) -> Speculator:
    config = engine.config.speculative_config
    max_len = engine.model_config.max_position_embeddings
    if config.method == "ngram":
        return Speculator(config, engine.blocks, max_len)
    if config.method == "mtp":
        return Speculator(config, engine.blocks, max_len, _mtp_drafter(engine, ops))
    return Speculator(config, engine.blocks, max_len, _draft_model(engine, ops))


def _proposer_cache(engine) -> KVCache:
    return KVCache(_proposer_kv_spec(engine), engine.blocks.num_blocks, engine.device)


def _mtp_drafter(engine, ops):
    from app.engine.spec.mtp import MTPProposer

    engine.runner.keep_hidden = True
    cache = _proposer_cache(engine)
    runner = mtp_runner(engine.model, cache, ops, engine.runner.scale, engine.device)
    send = None
    if engine.tp_group is not None:  # every rank runs the plan on its shard of the layer
        from app.engine.tp_driver import MTPDraft

        driver = engine.tp_group
        send = lambda plan: driver.send(MTPDraft(plan))  # noqa: E731
    return MTPProposer(runner, engine.blocks, send)


def mtp_runner(model, cache: KVCache, ops, scale: float, device):
    from app.engine.spec.mtp import MTPRunner

    return MTPRunner(model, cache, ops, scale, device)


def _draft_model(engine, ops):
    from app.engine.model_runner import ModelRunner
    from app.engine.spec.draft_model import DraftModelProposer
    from app.quant.load import load_model

    path = engine.config.speculative_config.model
    model, cfg = load_model(path, engine.dtype, engine.device)
    check_same_tokenizer(engine.config.model, engine.model_config, path, cfg)
    runner = ModelRunner(model, _proposer_cache(engine), ops, cfg.head_dim, engine.device)
    return DraftModelProposer(runner, engine.blocks)


def check_same_tokenizer(target: str, target_cfg, draft: str, draft_cfg) -> None:
    """A draft must speak the target's token ids: same vocabulary size and, where both
    folders have a tokenizer.json, the same vocabulary."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"draft model vocab_size {draft_cfg.vocab_size} != target's {target_cfg.vocab_size}"
        )
    vocabs = [_vocab(p) for p in (target, draft)]
    if None not in vocabs and vocabs[0] != vocabs[1]:
        raise ValueError("draft model's tokenizer differs from the target's")


def _vocab(path: str) -> dict | None:
    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        return None
    with open(file) as f:
        return json.load(f).get("model", {}).get("vocab")
