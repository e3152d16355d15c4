"""Operator configuration of the Serve application (pydantic: unknown fields are errors)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from app.config import EngineConfig
from app.options import OPTIONS, EngineOption, engine_config

# Where a served engine's default differs from the offline engine's (app/config.py).
SERVE_DEFAULTS: dict[str, Any] = {
    "kv_cache_dtype": "fp8_e4m3",  # the point of slimserve: half the KV bytes
    "kv_cache_memory_bytes": 64 << 20,  # a small fixed budget; set it for real deployments
    # Steps of 512 tokens for short prompts (the first of a burst get their first token
    # sooner), and of 2,048 that take whole prompts (vLLM's CPU server's budget) while a
    # prompt over 512 tokens is to be prefilled: a queue of long prompts then drains as
    # they arrive (docs/long_prompts.md "The served token budget": 1,000-token prompts at
    # 32 streams waited 2.6 s for their first token with 512-token steps).
    "max_num_batched_tokens": 2048,
    "long_prefill_chunk": 2048,
    "light_load_step_tokens": 512,
}
_PLACEHOLDER_MODEL = "<model>"  # deploy-time validation does not need the checkpoint


def _field(option: EngineOption) -> tuple[Any, Any]:
    """The pydantic (type, FieldInfo) of one engine option; choices become a Literal."""
    base: Any = dict[str, Any] if option.type is dict else option.type
    if option.choices:
        base = Literal[tuple(c for c in option.choices if c is not None)]
    typ = base | None if option.optional else base
    default = SERVE_DEFAULTS.get(option.name, option.default)
    return typ, Field(default=default, description=option.help)


_EngineFields = create_model(
    "_EngineFields",
    __config__=ConfigDict(extra="forbid"),
    **{name: _field(o) for name, o in OPTIONS.items() if name != "model"},
)


class EngineArgs(_EngineFields):
    """What each engine replica is built from: every option of app.config's dataclasses
    (derived from them, app/options.py), plus `model` (optional) and `torch_threads`.

    Validated at deploy time by building the EngineConfig, so a bad value fails here with
    the dataclass's own message, naming the field.
    """

    model: str | None = None  # None: the embedded default model
    # Torch threads of a step in which one sequence computes >= threaded_step_min_tokens new
    # tokens (a long prompt's prefill); other steps run on one (app/engine/step_threads.py).
    # "auto": the CPUs this replica's process may use (affinity, capped by a cgroup CPU
    # quota). None: leave torch's count alone (Ray sets OMP_NUM_THREADS=1 in a replica that
    # reserves no CPUs: replica_num_cpus=0).
    torch_threads: Annotated[int, Field(gt=0)] | Literal["auto"] | None = "auto"
    threaded_step_min_tokens: int = Field(default=256, gt=0)
    # Notes: tensor_parallel_size ranks run as Ray actors in the replica's placement group
    # (docs/parallelism.md); with speculative_config only decode (and colocated) replicas
    # speculate, prefill replicas never decode.

    @model_validator(mode="after")
    def _valid_engine(self) -> EngineArgs:
        self.engine_config(self.model or _PLACEHOLDER_MODEL)  # raises naming the field
        return self

    def step_threads(self) -> int | None:
        """torch_threads resolved: "auto" is the CPUs this process may use (its affinity,
        capped by a container's CPU limit)."""
        if self.torch_threads == "auto":
            from app.engine.step_threads import available_cpus  # torch: at replica start only

            return available_cpus()
        return self.torch_threads

    def engine_options(self) -> dict[str, Any]:
        """The flat engine options (app/options.py), without `model`."""
        return {name: getattr(self, name) for name in OPTIONS if name != "model"}

    def engine_config(self, model: str) -> EngineConfig:
        try:
            return engine_config({**self.engine_options(), "model": model})
        except TypeError as e:  # pydantic reports only ValueError / AssertionError
            raise ValueError(str(e)) from None


class ServeArgs(BaseModel):
    """Everything `build_app` needs; also the `args:` of deploy/*.yaml."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    engine: EngineArgs = Field(default_factory=EngineArgs)
    served_model_name: str | None = None  # None: the model folder's name
    num_prefill_replicas: int = Field(default=1, ge=1)
    num_decode_replicas: int = Field(default=1, ge=1)
    num_engine_replicas: int = Field(default=1, ge=1)  # colocated mode
    # Disaggregated: a prompt of at most this many tokens prefills on its decode replica
    # (conditional disaggregation, as NVIDIA Dynamo's): it fills no KV chunk, so the store
    # has nothing of it to reuse or share, and its hand-off costs more than its prefill.
    # None: every prompt shorter than one chunk (engine.chunk_tokens - 1); 0: every prompt
    # goes through a prefill replica. A prefill routing hint also sends it there.
    local_prefill_max_tokens: int | None = Field(default=None, ge=0)
    # Disaggregated, the overlapped hand-off (docs/serving.md): a prompt computed over
    # several steps has the KV chunks of each step published as soon as it ends, and its
    # decode call placed then, so the decode replica fetches and imports them while the
    # rest is computed. False: the prompt's KV is published after its first token.
    overlap_hand_off: bool = True
    # Disaggregated, where a prefill replica runs on its decode replica's cores or GPU
    # (app/serve/routing/compute.py): "local" prefills long prompts on the decode replica
    # unless it cannot hold them (a remote prefill there buys no compute and adds the
    # hand-off's work); "load" compares the two queues as for separate compute.
    prefill_on_shared_compute: Literal["local", "load"] = "local"
    # Disaggregated: a long prompt prefills on its decode replica only while a step of it
    # would make the running sequences' steps at most this many times slower (from the
    # replica's measured decode step time and prefill rate); None: no such cap.
    prefill_max_itl_slowdown: float | None = Field(default=None, gt=1)
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
    # Routing (app/serve/routing/router.py documents the policy).
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
    # holds later tokens up to this long so they share one (fewer Serve stream items per
    # token, coarser events; app/serve/streaming.py).
    stream_interval_s: float = Field(default=0.0, ge=0, le=1.0)
    # How deltas get from the engine replicas to the ingress (docs/serving.md "The delta
    # channel"): "socket" sends every request's deltas of one engine step in one msgpack
    # frame over one authenticated TCP connection per (ingress, replica) pair, TLS when
    # Ray runs with TLS (stream_interval_s does not apply); "serve" streams each request
    # through Serve (one item per delta; for clusters where replicas cannot connect to the
    # ingress's node). Calls are Serve handle calls either way.
    delta_channel: Literal["socket", "serve"] = "socket"

    @model_validator(mode="after")
    def _queue_bound(self) -> ServeArgs:
        if self.max_queued_requests == 0:
            raise ValueError("max_queued_requests must be -1 (no limit) or positive")
        return self

    @model_validator(mode="after")
    def _local_prefill_below_a_chunk(self) -> ServeArgs:
        limit, chunk = self.local_prefill_max_tokens, self.engine.chunk_tokens
        if limit is not None and limit >= chunk:
            raise ValueError(
                f"local_prefill_max_tokens ({limit}) must be below engine.chunk_tokens "
                f"({chunk}): a prompt that fills a KV chunk prefills on a prefill replica, "
                "which shares the chunk through the store"
            )
        return self

    @property
    def local_prefill_tokens(self) -> int:
        """The longest prompt (tokens) that prefills on its decode replica; 0: none."""
        if self.local_prefill_max_tokens is None:
            return self.engine.chunk_tokens - 1
        return self.local_prefill_max_tokens
