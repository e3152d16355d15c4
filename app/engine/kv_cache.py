"""The paged KV cache tensors and how many blocks a byte budget buys.

Layout (kernels/README.md): kv [L, P, num_blocks, block_size, Hkv, D] in the cache dtype,
and for FP8 the per-token-head scale exponents [L, P, num_blocks, block_size, Hkv] int8.
P = 2 planes (K and V) for MHA/GQA; P = 1 for MLA, whose one "head" per token is the
compressed latent + RoPE key (D = kv_lora_rank + qk_rope_head_dim) and whose V is a view of
that same plane (attention reads the latent as both key and value; the absorbed-weights
formulation, app/models/mla.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.block_hash import LAYOUT_VERSION

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    use_mla: bool = False  # one plane (latent + rope key); V aliases it
    # KV heads of the whole model (0: num_kv_heads). Exported chunks always carry all of them
    # (tensor-parallel ranks gather theirs on rank 0), so the chunk layout is "tp1" whatever
    # the replica's TP size: prefill and decode replicas may use different TP sizes.
    total_kv_heads: int = 0

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def num_planes(self) -> int:
        return 1 if self.use_mla else 2

    def bytes_per_token(self) -> int:
        per_head = self.head_dim * self.dtype.itemsize + (1 if self.is_fp8 else 0)
        return self.num_layers * self.num_planes * self.num_kv_heads * per_head

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    def num_blocks(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block()

    @property
    def dtype_name(self) -> str:
        return "fp8_e4m3" if self.is_fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def chunk_kv_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads

    @property
    def layout(self) -> str:
        """Names everything a reader of exported KV must agree on."""
        return (
            f"{LAYOUT_VERSION}:L{self.num_layers}:H{self.chunk_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:tp1" + (":mla" if self.use_mla else "")
        )


class KVCache:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device):
        if num_blocks <= 0:
            raise ValueError("KV cache budget is smaller than one block")
        self.spec = spec
        self.num_blocks = num_blocks
        shape = (spec.num_layers, spec.num_planes, num_blocks, spec.block_size)
        shape += (spec.num_kv_heads, spec.head_dim)
        self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.scales = (
            torch.zeros(shape[:-1], dtype=torch.int8, device=device) if spec.is_fp8 else None
        )

    def layer(self, i: int):
        """(k_cache, v_cache, k_scale, v_scale) views for layer i (MLA: v is k's plane)."""
        k, ks = self.kv[i, 0], None if self.scales is None else self.scales[i, 0]
        if self.spec.use_mla:
            return k, k, ks, ks
        return k, self.kv[i, 1], ks, None if self.scales is None else self.scales[i, 1]

    def read_tokens(self, block_ids: list[int], num_tokens: int):
        """First num_tokens tokens of block_ids: kv [L,P,n,Hkv,D], scales [L,P,n,Hkv] or None."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        kv = self.kv[:, :, ids].flatten(2, 3)[:, :, :num_tokens]
        scales = None
        if self.scales is not None:
            scales = self.scales[:, :, ids].flatten(2, 3)[:, :, :num_tokens]
        return kv.contiguous(), None if scales is None else scales.contiguous()

    def write_tokens(self, block_ids: list[int], kv: torch.Tensor, scales) -> None:
        """Inverse of read_tokens: kv [L,P,n,Hkv,D] into the first n slots of block_ids."""
        n, bs = kv.shape[2], self.spec.block_size
        for j, block in enumerate(block_ids):
            lo, hi = j * bs, min((j + 1) * bs, n)
            if lo >= hi:
                break
            self.kv[:, :, block, : hi - lo] = kv[:, :, lo:hi].to(self.kv.dtype)
            if self.scales is not None:
                self.scales[:, :, block, : hi - lo] = scales[:, :, lo:hi]
