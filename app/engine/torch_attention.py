"""Vectorized PyTorch attention ops for CPU serving (same signatures as
slimserve_kernels/reference.py).

The reference loops over sequences, which is clear but slow for a batch of decodes; here a
decode batch gathers every sequence's blocks at once ([B, max_blocks * block_size] keys),
masks past each length and runs one batched attention. Prefill reuses the reference.

`prepare_decode` + `decode_layer`: what every layer of one decode step shares (the gathered
block rows, the length mask, the write slots) is built once per step instead of once per
layer (PagedAttention uses them when the backend has them); same results as
kv_write + paged_decode_attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from slimserve_kernels.reference import is_fp8, kv_write, paged_prefill_attention

__all__ = [
    "DecodeContext",
    "decode_layer",
    "kv_write",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepare_decode",
]


def _gather(cache, scale, block_tables, dtype) -> torch.Tensor:
    """[B, maxb] tables -> [B, maxb * block_size, Hkv, D] dequantized."""
    return _gather_rows(cache, scale, block_tables.flatten().long(), block_tables.shape[0], dtype)


def _gather_rows(cache, scale, rows, b: int, dtype) -> torch.Tensor:
    """rows: [B * maxb] int64 block ids -> [B, maxb * block_size, Hkv, D] dequantized."""
    # index_select on a 2-D view is several times faster than advanced indexing on CPU.
    x = cache.view(cache.shape[0], -1).index_select(0, rows)
    x = x.view(b, -1, *cache.shape[2:])
    if not is_fp8(cache):
        return x if x.dtype == dtype else x.to(dtype)
    e = scale.view(scale.shape[0], -1).index_select(0, rows).view(b, -1, scale.shape[-1])
    return fp8_values(x, dtype) * torch.exp2(e.to(dtype)).unsqueeze(-1)


def fp8_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) for an FP8 x, on CPU through a 256-entry table: PyTorch's CPU cast
    converts element by element (~4 ns each; at 32 decodes it was 36-44% of a served step,
    docs/performance.md), the table gather is ~4x faster. Bit-exact (NaN codes included)."""
    if x.device.type != "cpu":
        return x.to(dtype)
    codes = x.view(torch.uint8).reshape(-1).to(torch.int32)  # index_select wants int32/64
    return _fp8_table(x.dtype, dtype).index_select(0, codes).view(x.shape)


@cache
def _fp8_table(fp8: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """[256] dtype: the value of every FP8 bit pattern."""
    return torch.arange(256, dtype=torch.uint8).view(fp8).to(dtype)


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


@dataclass(slots=True)
class DecodeContext:
    """What every layer of one decode step shares."""

    rows: torch.Tensor  # [B * max_blocks] int64: the block tables, flattened
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] float32: -inf past each length
    slots: torch.Tensor  # [T'] int64: the slots written (the >= 0 ones)
    kept: torch.Tensor | None  # [T'] int64: rows of k/v written; None = all of them


def prepare_decode(block_tables, seq_lens, slot_mapping, block_size: int) -> DecodeContext:
    width = block_tables.shape[1] * block_size
    pad = torch.arange(width, device=seq_lens.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = torch.zeros(pad.shape, dtype=torch.float32, device=pad.device)
    mask.masked_fill_(pad, float("-inf"))
    kept = None
    if bool((slot_mapping < 0).any()):  # padding rows (kv_write's "skip" slots)
        kept = (slot_mapping >= 0).nonzero()[:, 0]
        slot_mapping = slot_mapping[kept]
    rows = block_tables.flatten().long()
    return DecodeContext(rows, mask[:, None, None, :], slot_mapping, kept)


def decode_layer(ctx: DecodeContext, q, k, v, k_cache, v_cache, k_scale, v_scale, sm_scale):
    """kv_write of the new k/v [B, Hkv, D], then paged_decode_attention of q [B, Hq, D]."""
    if ctx.kept is not None:
        k, v = k.index_select(0, ctx.kept), v.index_select(0, ctx.kept)
    if is_fp8(k_cache):
        kv_write(k, v, k_cache, v_cache, k_scale, v_scale, ctx.slots)
    else:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, ctx.slots, _as(k, k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, ctx.slots, _as(v, v_cache.dtype))
    b, hq, d = q.shape
    keys = _gather_rows(k_cache, k_scale, ctx.rows, b, torch.float32).transpose(1, 2)
    values = _gather_rows(v_cache, v_scale, ctx.rows, b, torch.float32).transpose(1, 2)
    hkv = keys.shape[1]
    out = F.scaled_dot_product_attention(
        _as(q, torch.float32).view(b, hkv, hq // hkv, d), keys, values, attn_mask=ctx.mask,
        scale=sm_scale,
    )  # fmt: skip
    return _as(out.reshape(b, hq, d), q.dtype)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) without dispatching an op when it is already that dtype (every layer of
    every decode step calls this several times; a no-op .to() still costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)
