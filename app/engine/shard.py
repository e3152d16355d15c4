"""One rank's model and KV cache: what every tensor-parallel rank builds, rank 0 included.

Rank 0's Engine adds the tokenizer, scheduler, block manager and sampler on top; the other
ranks build only a `RankWorker` (model shard, cache shard, runner) and run what rank 0 sends
(app/engine/tp_driver.py). Every rank calls the same collectives in the same order: loading,
then `min_over_ranks` for the block count.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from app.config import CacheConfig, EngineConfig, ModelConfig
from app.engine.attention import backend_ops
from app.engine.kv_cache import KVCache
from app.engine.model_runner import ModelRunner
from app.engine.spec.factory import mtp_runner, uses_mtp
from app.engine.tp_driver import min_over_ranks
from app.kv.dtypes import resolve as resolve_kv_dtype
from app.kv.layout import KVCacheSpec
from app.models.parallel import TPContext
from app.quant import apply_weight_quant, set_fp8_activations
from app.quant.load import load_model


def load_rank_model(
    config: EngineConfig, tp: TPContext, device, dtype, progress=False, mtp=False
) -> tuple[nn.Module, ModelConfig]:
    """This rank's shard of the model, weight-quantized (weight_quant) if asked, its FP8
    linears running W8A8 or W8A16 as `fp8_activations` says."""
    model, model_config = load_model(config.model, dtype, device, tp, progress, mtp)
    if config.weight_quant is not None:
        apply_weight_quant(model, model_config, config.weight_quant)
    set_fp8_activations(model, config.fp8_activations)  # FP8 checkpoints or weight_quant="fp8"
    return model, model_config


def kv_cache_spec(model, cfg: ModelConfig, cache: CacheConfig, tp: TPContext, dtype) -> KVCacheSpec:
    """The model's own cache (MLA) or standard K/V planes of this rank's KV heads."""
    kv_dtype = resolve_kv_dtype(cache.kv_cache_dtype, dtype)
    spec = model.kv_cache_spec(cache.block_size, kv_dtype)
    if spec is not None:
        return spec
    return KVCacheSpec(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=tp.kv_heads(cfg.num_key_value_heads)[1],  # this rank's
        head_dim=cfg.head_dim,
        block_size=cache.block_size,
        dtype=kv_dtype,
        total_kv_heads=cfg.num_key_value_heads,
    )


def budget_blocks(cache: CacheConfig, spec: KVCacheSpec, device, extra_block_bytes=0) -> int:
    """Blocks the byte budget buys; extra_block_bytes: a proposer's KV sharing the ids."""
    budget = cache.kv_cache_memory_bytes
    if budget is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    budget = budget if budget is not None else cache.cpu_kv_cache_bytes
    return budget // (spec.bytes_per_block() + extra_block_bytes)


class RankWorker:
    """A worker rank (1..N-1): its model shard, KV cache shard and runner; nothing else."""

    def __init__(self, config: EngineConfig, ctx: TPContext, device: torch.device):
        self.ctx, self.device = ctx, device
        dtype = config.resolved_dtype()
        mtp = uses_mtp(config.speculative_config)
        model, cfg = load_rank_model(config, ctx, device, dtype, mtp=mtp)
        spec = kv_cache_spec(model, cfg, config.cache, ctx, dtype)
        mtp_spec = dataclasses.replace(spec, num_layers=1)  # the MTP layer's cache shard
        extra = mtp_spec.bytes_per_block() if mtp else 0
        # Rank 0 may count fewer blocks (a draft model's KV): the minimum wins on every rank.
        blocks = budget_blocks(config.cache, spec, device, extra)
        num_blocks = min_over_ranks(blocks, ctx, device)
        self.cache = KVCache(spec, num_blocks, device)
        ops = backend_ops(config.attention_backend, device)
        self.runner = ModelRunner(model, self.cache, ops, cfg.head_dim, device)
        self.mtp = None  # MTP speculation: this rank's shard of the MTP layer runs each plan
        if mtp:
            self.runner.keep_hidden = True
            cache = KVCache(mtp_spec, num_blocks, device)
            self.mtp = mtp_runner(model, cache, ops, self.runner.scale, device)
