"""The KV cache dtypes: one table row per dtype, read by the cache, codec, attention and config.

Adding a KV dtype is one `KVDtype` row here plus its kernels (slimserve_kernels/README.md):
the cache tensors, bytes per token, chunk payloads, salts and layouts all follow from the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVDtype:
    name: str  # canonical: in chunk headers, salts and metrics
    storage: torch.dtype  # the cache tensor's dtype
    aliases: tuple[str, ...] = ()  # other config spellings ("bf16")
    # Scales beside the values (None: the values are the numbers). "token-head": one scale per
    # token and KV head, [L, P, blocks, block_size, Hkv]; int8 holds a power-of-two exponent.
    scale: torch.dtype | None = None
    scale_granularity: str | None = None

    @property
    def has_scales(self) -> bool:
        return self.scale is not None

    def bytes_per_token_head(self, head_dim: int) -> int:
        scale = self.scale.itemsize if self.scale is not None else 0
        return head_dim * self.storage.itemsize + scale


KV_DTYPES: tuple[KVDtype, ...] = (
    KVDtype("fp8_e4m3", torch.float8_e4m3fn, scale=torch.int8, scale_granularity="token-head"),
    KVDtype("bfloat16", torch.bfloat16, aliases=("bf16",)),
    KVDtype("float16", torch.float16, aliases=("fp16",)),
    KVDtype("float32", torch.float32, aliases=("fp32",)),
)
_BY_NAME = {n: d for d in KV_DTYPES for n in (d.name, *d.aliases)}
_BY_STORAGE = {d.storage: d for d in KV_DTYPES}
# Config spellings of kv_cache_dtype: "auto" follows the model dtype.
CONFIG_NAMES: tuple[str, ...] = ("auto", *sorted(_BY_NAME))


def kv_dtype(value: str | torch.dtype | KVDtype) -> KVDtype:
    """The table row for a name, an alias or a storage dtype; ValueError names the choices."""
    if isinstance(value, KVDtype):
        return value
    row = _BY_STORAGE.get(value) if isinstance(value, torch.dtype) else _BY_NAME.get(value)
    if row is None:
        raise ValueError(f"unsupported KV dtype {value!r}; expected one of {sorted(_BY_NAME)}")
    return row


def resolve(name: str, model_dtype: torch.dtype) -> KVDtype:
    """A kv_cache_dtype config value: "auto" is the model's own dtype."""
    return kv_dtype(model_dtype if name == "auto" else name)
