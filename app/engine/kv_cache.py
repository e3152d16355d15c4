"""The paged KV cache tensors of one rank (what they hold: app/kv/layout.py KVCacheSpec).

kv [L, P, num_blocks, block_size, Hkv, D] in the dtype's storage type and, for a dtype with
scales (FP8), scales [L, P, num_blocks, block_size, Hkv] (slimserve_kernels/README.md).
For MLA (P = 1) V is a view of the one plane: attention reads the latent as both key and value (the
absorbed-weights formulation, app/models/mla.py).
"""

from __future__ import annotations

import torch

from app.kv.layout import KVCacheSpec
from slimserve_kernels import cpu_tag


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
        # every layer's views, made once (a forward asks for each layer's, every step)
        self._layers = [self._layer_views(i) for i in range(kv_shape[0])]

    def layer(self, i: int):
        """(k_cache, v_cache, k_scale, v_scale) views for layer i (MLA: v is k's plane)."""
        return self._layers[i]

    def _layer_views(self, i: int):
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

    def write_layer_blocks(self, layer: int, blocks: list[tuple[int, int]], kv, scales) -> None:
        """One layer of whole blocks: (j, block_id) pairs take tokens [j*bs, (j+1)*bs) of
        kv [P, n, Hkv, D] (scales [P, n, Hkv] or None). An import writes layer by layer,
        checking the tag as it goes; runs of consecutive blocks are one copy each."""
        bs = self.spec.block_size
        for j, block, k in _runs(blocks):
            tokens = slice(j * bs, (j + k) * bs)
            dst = _bits(self.kv[layer, :, block : block + k])  # [P, k, bs, Hkv, D]
            dst.copy_(_bits(kv[:, tokens].to(self.kv.dtype)).reshape(dst.shape))
            if self.scales is not None:
                dst = self.scales[layer, :, block : block + k]
                dst.copy_(scales[:, tokens].reshape(dst.shape))

    def copies_in_kernel(self, kv: torch.Tensor) -> bool:
        """Whether write_blocks can take kv [L, P, n, Hkv, D]: a CPU cache of kv's dtype, kv
        contiguous (a chunk's payload), and the C++ copy built (slimserve_kernels/cpu_tag)."""
        return (
            self.kv.is_cpu
            and kv.dtype == self.kv.dtype
            and kv.is_contiguous()
            and cpu_tag.available()
        )

    def write_blocks(
        self, blocks: list[tuple[int, int]], kv, scales, tag: cpu_tag.CopyingTag | None = None
    ) -> None:
        """Every layer of whole blocks ((j, block_id) as in write_layer_blocks) in one C++
        call per tensor (`copies_in_kernel(kv)` must hold). tag: fed every byte of kv, then
        of scales, in payload order (the blocks not written too), in the same pass."""
        runs = _runs(blocks)
        cpu_tag.copy_blocks(kv, self.kv, runs, tag)
        if self.scales is not None:
            cpu_tag.copy_blocks(scales, self.scales, runs, tag)


def _runs(blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(j, block_id) pairs -> (j, first block_id, length) of runs consecutive in both."""
    runs: list[tuple[int, int, int]] = []
    for j, block in blocks:
        if runs and runs[-1][0] + runs[-1][2] == j and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, block, 1))
    return runs


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t viewed as the integer type of its width: a plain copy (FP8 copy_ is slower)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
