"""Vectorized PyTorch attention ops for CPU serving (same signatures as kernels/reference.py).

The reference loops over sequences, which is clear but slow for a batch of decodes; here a
decode batch gathers every sequence's blocks at once ([B, max_blocks * block_size] keys),
masks past each length and runs one batched attention. Prefill reuses the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import is_fp8, kv_write, paged_prefill_attention

__all__ = ["kv_write", "paged_decode_attention", "paged_prefill_attention"]


def _gather(cache, scale, block_tables, dtype) -> torch.Tensor:
    """[B, maxb] tables -> [B, maxb * block_size, Hkv, D] dequantized."""
    b, width = block_tables.shape
    rows = block_tables.flatten().long()
    # index_select on a 2-D view is several times faster than advanced indexing on CPU.
    x = cache.view(cache.shape[0], -1).index_select(0, rows)
    x = x.view(b, width * cache.shape[1], *cache.shape[2:]).to(dtype)
    if not is_fp8(cache):
        return x
    e = scale.view(scale.shape[0], -1).index_select(0, rows).view(b, -1, scale.shape[-1])
    return x * torch.exp2(e.to(dtype)).unsqueeze(-1)


def paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, sm_scale):
    """q: [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    dtype = torch.float32
    k = _gather(k_cache, k_scale, block_tables, dtype).transpose(1, 2)  # [B, Hkv, S, D]
    v = _gather(v_cache, v_scale, block_tables, dtype).transpose(1, 2)
    hkv = k.shape[1]
    pad = torch.arange(k.shape[2], device=q.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = torch.zeros(pad.shape, dtype=dtype, device=q.device).masked_fill_(pad, float("-inf"))
    # GQA without repeating K/V: the query heads sharing a KV head are its "query rows".
    out = F.scaled_dot_product_attention(
        q.to(dtype).view(b, hkv, hq // hkv, d),  # [B, Hkv, G, D]
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=sm_scale,
    )
    return out.reshape(b, hq, d).to(q.dtype)
