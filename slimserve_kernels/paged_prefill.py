"""Causal varlen prefill / extend attention over the paged cache (write-then-read).

Sequence b's new queries are rows query_start_loc[b]:query_start_loc[b+1] of q, at positions
seq_lens[b] - qlen .. seq_lens[b] - 1; every key (cached prefix or new) is read from the
paged cache. One program per (query tile, query head, sequence); a tile only visits keys up
to its last query's position, so the work is causal-trimmed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.attn_common import PagedCache, attend_paged, check_cache, dot_operands


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    qsl_ptr,
    lens_ptr,
    o_ptr,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_eb,
    stride_et,
    stride_eh,
    stride_btb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if tile * BLOCK_M < q_len:
        seq_len = tl.load(lens_ptr + b)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row within the sequence
        offs_d = tl.arange(0, BLOCK_D)
        mmask = offs_m < q_len
        dmask = offs_d < HEAD_DIM
        qpos = seq_len - q_len + offs_m  # absolute positions of these queries
        rows = (q_start + offs_m).to(tl.int64)
        q_ptrs = q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mmask[:, None] & dmask[None, :], other=0.0)

        cache = (kc_ptr, vc_ptr, ks_ptr, vs_ptr)
        strides = (stride_cb, stride_ct, stride_ch, stride_eb, stride_et, stride_eh)
        end = tl.minimum(seq_len - q_len + (tile + 1) * BLOCK_M, seq_len)
        kv = (bt_ptr + b * stride_btb, cache, h // GROUP, strides)
        out, _, _ = attend_paged(q, qpos, mmask, 0, end, kv, sm_scale, offs_d, dmask,
                                 BLOCK_N, BLOCK_SIZE, IS_FP8, CAUSAL=True,
                                 PRECISION=PRECISION)  # fmt: skip
        o_ptrs = o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], new tokens of all sequences, concatenated
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8 (fp8 cache only)
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    sm_scale: float,
    block_m: int | None = None,
    block_n: int = 32,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.paged_prefill_attention`.

    `max_query_len` (if the caller knows it) avoids a device-to-host sync for the grid.
    Default tiles: 64 queries x 32 keys with 8 warps for D <= 128, 32 x 32 for D = 256
    (the largest that compile for sm_90 without register spills).
    """
    t, hq, d = q.shape
    hkv, block_size = check_cache(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens)
    bsz = seq_lens.shape[0]
    assert query_start_loc.shape == (bsz + 1,) and query_start_loc.dtype == torch.int32
    assert query_start_loc.is_contiguous()
    out = torch.empty_like(q)
    q, precision = dot_operands(q, k_cache)
    if t == 0 or bsz == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    cache = PagedCache.of(k_cache, v_cache, k_scale, v_scale)
    block_m = block_m or (64 if d <= 128 else 32)
    grid = (triton.cdiv(max_query_len, block_m), hq, bsz)
    _prefill_kernel[grid](
        q,
        *cache.tensors,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        sm_scale,
        q.stride(0),
        q.stride(1),
        *cache.strides,
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=hq // hkv,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=block_n,
        IS_FP8=cache.is_fp8,
        PRECISION=precision,
        num_warps=8,
    )
    return out
