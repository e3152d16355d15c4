"""Configuration dataclasses at the engine's boundaries; each validates itself."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from app.kv.dtypes import CONFIG_NAMES as KV_DTYPES

_TORCH_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


@dataclass(slots=True)
class ModelConfig:
    """The subset of a Hugging Face config.json the models use."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization_config: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        assert self.num_attention_heads % self.num_key_value_heads == 0, "GQA ratio must be whole"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        heads = hf["num_attention_heads"]
        arch = archs[0]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=hf.get("rope_scaling") or (hf.get("rope_parameters") or None),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM" or bool(hf.get("use_qk_norm", False)),  # GLM
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
            quantization_config=hf.get("quantization_config"),
            raw=hf,
        )

    @classmethod
    def from_path(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f))


def _rope_theta(hf: dict[str, Any]) -> float:
    # transformers >= 5 moved rope_theta into rope_parameters.
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None  # None: a fraction of free memory
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_bytes: int = 256 << 20  # default budget on CPU
    enable_prefix_caching: bool = True
    chunk_tokens: int = 256

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.block_size <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError("block_size must be positive and divide chunk_tokens")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget
    max_waiting: int = 1024  # admission limit: beyond this add_request raises Overloaded
    long_prefill_chunk: int = 512  # chunked prefill: max new tokens of one sequence per step

    def __post_init__(self):
        assert self.max_num_seqs > 0 and self.max_num_batched_tokens > 0
        assert self.long_prefill_chunk > 0 and self.max_waiting > 0


SPECULATIVE_METHODS = ("ngram", "mtp", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative_decoding.md); names follow vLLM's."""

    method: str = "ngram"  # ngram | mtp | draft_model
    num_speculative_tokens: int = 3  # k: tokens proposed (and verified) per step
    prompt_lookup_min: int = 2  # ngram: shortest n-gram matched
    prompt_lookup_max: int = 4  # ngram: longest n-gram matched (tried first)
    model: str | None = None  # draft_model: checkpoint path (same tokenizer as the target)
    backoff: bool = True  # propose fewer (down to none) while few proposals are accepted

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative 'model' is required for, and only for, draft_model")

    @classmethod
    def from_any(cls, value) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or a dict of its fields (unknown keys rejected)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {sorted(unknown)}")
        return cls(**value)


@dataclass(slots=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto: bf16 on CUDA, float32 on CPU
    device: str = "auto"
    weight_quant: str | None = None  # None | "int4" | "fp8" (quantize on load)
    attention_backend: str = "auto"  # auto | torch | reference | triton
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts partitioned across TP ranks
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        if self.weight_quant not in (None, "int4", "fp8"):
            raise ValueError(
                f"weight_quant must be None, 'int4' or 'fp8', got {self.weight_quant!r}"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.attention_backend not in ("auto", "torch", "reference", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return torch_dtype(self.dtype)

    def kv_dtype(self) -> torch.dtype:
        if self.cache.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        return torch_dtype(self.cache.kv_cache_dtype)
