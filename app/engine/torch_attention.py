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
    x = cache[block_tables.long()].flatten(1, 2)
    if not is_fp8(cache):
        return x.to(dtype)
    e = scale[block_tables.long()].flatten(1, 2)
    return x.to(dtype) * torch.exp2(e.to(dtype)).unsqueeze(-1)


def paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, sm_scale):
    """q: [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    dtype = torch.float32
    k = _gather(k_cache, k_scale, block_tables, dtype).transpose(1, 2)  # [B, Hkv, S, D]
    v = _gather(v_cache, v_scale, block_tables, dtype).transpose(1, 2)
    pad = torch.arange(k.shape[2], device=q.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = torch.zeros(pad.shape, dtype=dtype, device=q.device).masked_fill_(pad, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.to(dtype).unsqueeze(2),  # [B, Hq, 1, D]
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=sm_scale,
        enable_gqa=True,
    )
    return out.squeeze(2).to(q.dtype)
