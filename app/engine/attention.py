"""Attention backends: paged attention over the KV cache, called by the model per layer.

The engine writes the step's new K/V into the cache, then attends over the cache
(write-then-read, see slimserve_kernels/README.md). A backend is a table of three ops with the
signatures of slimserve_kernels/reference.py; the reference runs everywhere, Triton on CUDA.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch

from app.engine.kv_cache import KVCache


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32
    is_decode: bool  # every sequence has exactly one new token


def backend_ops(name: str, device: torch.device):
    """An object providing kv_write / paged_decode_attention / paged_prefill_attention."""
    if name == "reference":
        return importlib.import_module("slimserve_kernels.reference")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return importlib.import_module("app.engine.torch_attention")
    kernels = importlib.import_module("slimserve_kernels")
    if name == "auto":  # Triton on CUDA, reference elsewhere, decided per call
        return kernels
    if name == "triton":  # always Triton (the interpreter on CPU)
        return SimpleNamespace(
            kv_write=kernels.triton_kv_write,
            paged_decode_attention=kernels.triton_paged_decode_attention,
            paged_prefill_attention=kernels.triton_paged_prefill_attention,
        )
    raise ValueError(f"unknown attention backend {name!r}")


_NO_CONTEXT = object()  # the backend's per-step path declined this step (a long prefill)


class PagedAttention:
    """Binds a backend to one forward pass: the model calls it as attn(layer, q, k, v)."""

    def __init__(self, ops: ModuleType, cache: KVCache, meta: AttentionMetadata, scale: float):
        self.ops, self.cache, self.meta, self.scale = ops, cache, meta, scale
        self.decode_ctx = None  # a backend's per-step decode state, built at the first layer

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        """v None (MLA): the cache has one plane and V reads it too (vc is kc), so the
        write below stores k twice into the same slots; the output is [T, Hq, D of k]."""
        kc, vc, ks, vs = self.cache.layer(layer)
        assert (v is None) == self.cache.spec.use_mla, "v=None exactly when the cache is MLA"
        v = k if v is None else v
        m = self.meta
        if hasattr(self.ops, "decode_layer"):  # shares per-step work (decodes, verify steps)
            if self.decode_ctx is None:
                bs = self.cache.spec.block_size
                starts = None if m.is_decode else m.query_start_loc
                args = (m.block_tables, m.seq_lens, m.slot_mapping, bs, starts)
                fp8 = kc.dtype == torch.float8_e4m3fn  # the C++ kernel takes its long prefills
                self.decode_ctx = self.ops.prepare_decode(*args, fp8_cache=fp8) or _NO_CONTEXT
            if self.decode_ctx is not _NO_CONTEXT:
                return self.ops.decode_layer(self.decode_ctx, q, k, v, kc, vc, ks, vs, self.scale)
        self.ops.kv_write(k, v, kc, vc, ks, vs, m.slot_mapping)
        if m.is_decode:
            return self.ops.paged_decode_attention(
                q, kc, vc, ks, vs, m.block_tables, m.seq_lens, self.scale
            )
        return self.ops.paged_prefill_attention(
            q, kc, vc, ks, vs, m.block_tables, m.query_start_loc, m.seq_lens, self.scale
        )
