"""The paged KV cache tensors of one rank (what they hold: app/kv/layout.py KVCacheSpec).

kv [L, P, num_blocks, block_size, Hkv, D] in the dtype's storage type and, for a dtype with
scales (FP8), scales [L, P, num_blocks, block_size, Hkv] (kernels/README.md). For MLA (P = 1)
V is a view of the one plane: attention reads the latent as both key and value (the
absorbed-weights formulation, app/models/mla.py).
"""

from __future__ import annotations

import torch

from app.kv.layout import KVCacheSpec


class KVCache:
    layer_writes = True  # write_layer_blocks writes every head (a TP shard's cache: False)

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device):
        if num_blocks <= 0:
            raise ValueError("KV cache budget is smaller than one block")
        self.spec = spec
        self.num_blocks = num_blocks
        kv_shape, scale_shape = spec.tensor_shapes(num_blocks)
        self.kv = torch.zeros(kv_shape, dtype=spec.dtype.storage, device=device)
        self.scales = None
        if scale_shape is not None:
            self.scales = torch.zeros(scale_shape, dtype=spec.dtype.scale, device=device)

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

    def write_layer_blocks(self, layer: int, block_ids: list[int], kv: torch.Tensor, scales):
        """One layer of whole blocks: kv [P, len(block_ids) * block_size, Hkv, D], scales
        [P, same, Hkv] or None (an import writes layer by layer, checking the tag as it goes)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)
        shape = (kv.shape[0], len(block_ids), self.spec.block_size)
        src = kv.reshape(*shape, *kv.shape[2:]).to(self.kv.device, self.kv.dtype)
        _bits(self.kv[layer]).index_copy_(1, ids, _bits(src))  # no index_copy_ for FP8
        if self.scales is not None:
            src = scales.reshape(*shape, *scales.shape[2:]).to(self.kv.device)
            self.scales[layer].index_copy_(1, ids, src)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as the integer type of its width (copies bits, whatever the dtype)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
