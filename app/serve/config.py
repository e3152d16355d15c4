"""Operator configuration of the Serve application (pydantic: unknown fields are errors)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EngineArgs(BaseModel):
    """What each engine replica is built from (mirrors app.config.EngineConfig)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_dtype: str = "fp8_e4m3"
    kv_cache_memory_bytes: int | None = Field(default=64 << 20, gt=0)
    block_size: int = Field(default=16, gt=0)
    chunk_tokens: int = Field(default=256, gt=0)
    max_num_seqs: int = Field(default=64, gt=0)
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    weight_quant: str | None = None
    torch_threads: int | None = Field(default=None, gt=0)  # None: torch's default
    # Ranks per replica (docs/parallelism.md): workers are Ray actors in its placement group.
    tensor_parallel_size: int = Field(default=1, ge=1)
    enable_expert_parallel: bool = False
    # app.config.SpeculativeConfig's fields, e.g. {method: ngram, num_speculative_tokens: 3}.
    # Decode (and colocated) replicas speculate; prefill replicas never decode.
    speculative_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chunk_is_whole_blocks(self) -> EngineArgs:
        if self.chunk_tokens % self.block_size:
            raise ValueError("chunk_tokens must be a multiple of block_size")
        if self.speculative_config is not None:  # unknown keys and bad values fail here
            from app.config import SpeculativeConfig  # lazily: app.config imports torch

            SpeculativeConfig.from_any(self.speculative_config)
        return self


class ServeArgs(BaseModel):
    """Everything `build_app` needs; also the `args:` of deploy/*.yaml."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineArgs = Field(default_factory=EngineArgs)
    served_model_name: str | None = None  # None: the model folder's name
    num_prefill_replicas: int = Field(default=1, ge=1)
    num_decode_replicas: int = Field(default=1, ge=1)
    num_engine_replicas: int = Field(default=1, ge=1)  # colocated mode
    replica_num_cpus: float = Field(default=0.0, ge=0)
    replica_num_gpus: float = Field(default=0.0, ge=0)
    # Backpressure: beyond these, requests get HTTP 429 with Retry-After.
    max_ongoing_requests: int = Field(default=32, ge=1)
    max_queued_requests: int = Field(default=64, ge=-1)  # -1: unbounded (Serve's rule)
    retry_after_s: int = Field(default=1, ge=1)
    # Shared KV store.
    store_capacity_bytes: int = Field(default=512 << 20, gt=0)
    store_shards: int = Field(default=1, ge=1)
    store_name: str = "slimserve-kvstore"
    # Routing (app/serve/router.py documents the policy).
    routing_stats_period_s: float = Field(default=0.5, gt=0)
    allow_routing_hints: bool = False  # honour x-slimserve-*-replica headers (tests, ops)
    # Tenancy: the cache salt comes from the operator, never from the request body.
    api_key_cache_salts: dict[str, str] = Field(default_factory=dict)
    cache_salt_header: str | None = None  # set only behind a proxy that strips it
    # gRPC: reject calls whose API key (metadata) is not in api_key_cache_salts.
    grpc_require_api_key: bool = False
    max_prompt_tokens: int | None = Field(default=None, gt=0)  # None: the model's context
    # HTTP bodies above this get 413 before they are parsed or tokenized.
    max_request_bytes: int = Field(default=8 << 20, gt=0)
    request_timeout_s: float = Field(default=300.0, gt=0)
    # Streaming: tokens queued while the ingress lags always share one delta; > 0 also
    # holds later tokens up to this long so they share one (fewer Ray items per token,
    # coarser events; app/serve/streaming.py, docs/performance.md).
    stream_interval_s: float = Field(default=0.0, ge=0, le=1.0)

    @model_validator(mode="after")
    def _queue_bound(self) -> ServeArgs:
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests must be -1 (no limit) or positive")
        return self
