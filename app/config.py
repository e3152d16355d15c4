"""Configuration dataclasses at the engine's boundaries; each validates itself.

These are the single source of the engine's options: each field's `metadata` (`opt(...)`)
carries its help text and choices, and app/options.py derives from them the `LLM(...)`
keyword arguments, the CLI flags and the Serve config's `engine:` fields. Adding an option is
adding a field here (with `opt`); every front end then has it.

torch is imported only where a torch dtype or device is made, so that light modules (the
gRPC proxy, config validation at deploy time) can read these without it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The config spellings of app/kv/dtypes.py's table (app.kv.dtypes.CONFIG_NAMES), written out
# because that table needs torch; tests/test_options.py keeps the two equal.
KV_DTYPES = ("auto", "bf16", "bfloat16", "float16", "float32", "fp16", "fp32", "fp8_e4m3")
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
ATTENTION_BACKENDS = ("auto", "torch", "reference", "triton")
WEIGHT_QUANTS = (None, "int4", "fp8")
FP8_ACTIVATIONS = ("auto", "w8a16", "w8a8")
_TORCH_DTYPES = {  # name -> torch attribute
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "fp8_e4m3": "float8_e4m3fn",
}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in _TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_TORCH_DTYPES)}")
    return getattr(torch, _TORCH_DTYPES[name])


def opt(default: Any = None, help: str = "", choices: tuple | None = None, **kw) -> Any:
    """A dataclass field that is also an engine option (app/options.py reads the metadata)."""
    meta = {"help": help, "choices": choices}
    if "default_factory" in kw:
        return field(default_factory=kw.pop("default_factory"), metadata=meta)
    return field(default=default, metadata=meta)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _choice(name: str, value: Any, choices: tuple) -> None:
    _check(value in choices, f"{name} must be one of {choices}, got {value!r}")


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
    block_size: int = opt(16, "tokens per KV cache block")
    kv_cache_dtype: str = opt("auto", "KV cache dtype (auto: the activation dtype)", KV_DTYPES)
    kv_cache_memory_bytes: int | None = opt(
        None, "KV cache budget in bytes (unset: gpu_memory_utilization of free GPU memory)"
    )
    gpu_memory_utilization: float = opt(0.85, "fraction of free GPU memory for the KV cache")
    cpu_kv_cache_bytes: int = opt(256 << 20, "KV cache budget on CPU when no budget is set")
    enable_prefix_caching: bool = opt(True, "reuse the KV of shared prompt prefixes")
    chunk_tokens: int = opt(256, "tokens per KV chunk exchanged with the store (x block_size)")

    def __post_init__(self):
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_DTYPES)
        _check(_positive_int(self.block_size), "block_size must be a positive integer")
        _check(
            _positive_int(self.chunk_tokens) and self.chunk_tokens % self.block_size == 0,
            "chunk_tokens must be a positive multiple of block_size",
        )
        budget = self.kv_cache_memory_bytes
        _check(budget is None or _positive_int(budget), "kv_cache_memory_bytes must be > 0")
        _check(_positive_int(self.cpu_kv_cache_bytes), "cpu_kv_cache_bytes must be > 0")
        util = self.gpu_memory_utilization
        _check(_is_real(util) and 0 < util <= 1, "gpu_memory_utilization must be in (0, 1]")
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching: a bool")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = opt(64, "sequences in one step's batch, at most")
    max_num_batched_tokens: int = opt(2048, "tokens computed in one step, at most")
    max_waiting: int = opt(1024, "waiting sequences, at most (beyond: Overloaded, HTTP 429)")
    long_prefill_chunk: int = opt(512, "chunked prefill: new tokens of one sequence per step")
    light_load_step_tokens: int | None = opt(
        None,
        "tokens per step (and per sequence) while no prompt left to compute is longer than "
        "this; None: max_num_batched_tokens always",
    )
    decode_steps_after_prefill: int = opt(
        0,
        "decode-only steps after a step with a long prompt chunk "
        "(prefill_chunk_for_decode_steps), while sequences decode; 0: every step mixes them",
    )
    prefill_chunk_for_decode_steps: int = opt(
        256, "a prompt chunk this long is followed by decode_steps_after_prefill decode steps"
    )

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            _check(_positive_int(getattr(self, name)), f"{name} must be a positive integer")
        _check(_positive_int(self.long_prefill_chunk), "long_prefill_chunk must be positive")
        light = self.light_load_step_tokens
        _check(light is None or _positive_int(light), "light_load_step_tokens must be > 0")
        k = self.decode_steps_after_prefill
        _check(_positive_int(k) or _is_zero(k), "decode_steps_after_prefill must be an int >= 0")
        _check(
            _positive_int(self.prefill_chunk_for_decode_steps),
            "prefill_chunk_for_decode_steps must be a positive integer",
        )


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def _is_zero(x: Any) -> bool:
    return type(x) is int and x == 0  # not False, not 0.0


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x


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
    # ... or while verifying costs more wall time per token than plain decoding (cost.py)
    cost_aware: bool = True

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
    model: str = opt("", "checkpoint folder (Hugging Face layout)")
    dtype: str = opt("auto", "activation dtype (auto: bf16 on CUDA, float32 on CPU)", DTYPES)
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    weight_quant: str | None = opt(
        None, "quantize weights on load (int4: W4A16, fp8)", WEIGHT_QUANTS
    )
    fp8_activations: str = opt(
        "auto",
        "FP8 weights on CUDA: w8a16 (bf16 activations), w8a8 (FP8 per-token-group activations),"
        " auto (w8a8 where FP8 tensor cores, outputs of >= 1024 columns and < 1024 tokens,"
        " measured on an H100; app/quant/fp8_activations.py)",
        FP8_ACTIVATIONS,
    )
    attention_backend: str = opt("auto", "attention implementation", ATTENTION_BACKENDS)
    tensor_parallel_size: int = opt(1, "ranks the model is split over")
    enable_expert_parallel: bool = opt(False, "MoE: whole experts partitioned across TP ranks")
    seed: int = opt(0, "engine seed (requests without their own seed)")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = opt(
        None, "speculative decoding: SpeculativeConfig's fields, e.g. {method: ngram}"
    )
    enforce_eager: bool = opt(False, "no CUDA graphs: decode steps run eagerly (CUDA only)")

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        _check(isinstance(self.model, str) and bool(self.model), "model: a checkpoint folder")
        _choice("dtype", self.dtype, DTYPES)
        _choice("weight_quant", self.weight_quant, WEIGHT_QUANTS)
        _choice("fp8_activations", self.fp8_activations, FP8_ACTIVATIONS)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        tp = self.tensor_parallel_size
        _check(_positive_int(tp), f"tensor_parallel_size must be >= 1, got {tp!r}")
        _check(isinstance(self.seed, int), "seed must be an integer")

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        return torch_dtype(self.dtype)

    def kv_dtype(self) -> torch.dtype:
        if self.cache.kv_cache_dtype == "auto":
            return self.resolved_dtype()
        return torch_dtype(self.cache.kv_cache_dtype)
