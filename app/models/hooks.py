"""The hooks a model family offers the loader, the engine and quantization, declared once.

`CausalLM` is the protocol every registered class meets; `ModelHooks` gives the defaults, so
a family overrides only what differs (MLA's cache, a YaRN softmax scale, experts another
rank owns) and callers never probe with hasattr.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch

from app.kv.dtypes import KVDtype
from app.kv.layout import KVCacheSpec

# checkpoint fragment -> (our parameter fragment, shard id: "q"/"k"/"v", 0/1, or None)
PackedMapping = dict[str, tuple[str, "int | str | None"]]


@runtime_checkable
class CausalLM(Protocol):
    packed_modules_mapping: ClassVar[PackedMapping]
    # softmax scale when it is not head_dim**-0.5 (MLA, YaRN mscale); None otherwise
    attn_scale: float | None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """ids, positions [T] -> hidden [T, hidden]; attn(layer, q, k, v) is paged attention."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] float32."""
        ...

    def kv_cache_spec(self, block_size: int, dtype: KVDtype) -> KVCacheSpec | None:
        """The model's own cache shape (MLA), or None for the standard K/V planes."""
        ...

    def skips_weight(self, name: str) -> bool:
        """True for checkpoint tensors this rank does not hold (experts of another EP rank)."""
        ...

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name for a checkpoint tensor name (MTP layers are renamed)."""
        ...

    def add_mtp_layers(self, tp) -> None:
        """Build the checkpoint's multi-token-prediction layers (MTP speculative decoding);
        ValueError for families that have none."""
        ...


class ModelHooks:
    """Defaults of the CausalLM hooks; model families inherit and override."""

    packed_modules_mapping: ClassVar[PackedMapping] = {}
    attn_scale: float | None = None

    def kv_cache_spec(self, block_size: int, dtype: KVDtype) -> KVCacheSpec | None:
        return None

    def skips_weight(self, name: str) -> bool:
        return False

    def checkpoint_name(self, name: str) -> str:
        return name

    def add_mtp_layers(self, tp) -> None:
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction layers")


def attn_scale(model: CausalLM, head_dim: int) -> float:
    return model.attn_scale or head_dim**-0.5
