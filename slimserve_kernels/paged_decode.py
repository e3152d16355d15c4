"""Paged decode attention (flash-decoding) over an FP8 / BF16 / FP16 / FP32 paged KV cache.

One program per (sequence, KV head, KV split): it loads the KV head once and attends all
`Hq // Hkv` query heads of its GQA group with it (padded to 16 rows for `tl.dot`).
With one split it writes the output directly (single pass); with several, each split writes
a normalized partial output and its log-sum-exp, and `_reduce_kernel` combines them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.attn_common import PagedCache, attend_paged, check_cache, dot_operands
from slimserve_kernels.device import num_sms


@triton.jit
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    lens_ptr,
    o_ptr,
    lse_ptr,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_eb,
    stride_et,
    stride_eh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_SPLIT_TILES: tl.constexpr,
    IS_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    # This sequence's split count, sized here from its own length (no host sync, so a CUDA
    # graph replays it for any lengths): at least MIN_SPLIT_TILES tiles per split, at most the
    # grid's NUM_SPLITS; splits past it are empty. Each covers a whole number of tiles.
    tiles = tl.cdiv(seq_len, BLOCK_N)
    splits = tl.minimum(tl.maximum(tiles // MIN_SPLIT_TILES, 1), NUM_SPLITS)
    tiles_per_split = tl.cdiv(tiles, splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hkv * GROUP + offs_h  # [BLOCK_H] query heads of this group
    hmask = offs_h < GROUP
    dmask = offs_d < HEAD_DIM
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=hmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    cache = (kc_ptr, vc_ptr, ks_ptr, vs_ptr)
    strides = (stride_cb, stride_ct, stride_ch, stride_eb, stride_et, stride_eh)
    # Causal/length mask is per key only: every query row sees all keys < seq_len.
    kv = (bt_ptr + b * stride_btb, cache, hkv, strides)
    out, m_i, l_i = attend_paged(q, heads, hmask, start, end, kv, sm_scale, offs_d, dmask,
                                 BLOCK_N, BLOCK_SIZE, IS_FP8, CAUSAL=False,
                                 PRECISION=PRECISION)  # fmt: skip
    o_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
    tl.store(
        o_ptrs + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=hmask[:, None] & dmask[None, :],
    )
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))  # log2
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _reduce_kernel(
    part_ptr,
    lse_ptr,
    o_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # [BLOCK_S]; log2 units; split 0 is never empty
    p_ptrs = part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
    part = tl.load(
        p_ptrs + offs_d[None, :], mask=smask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0
    )
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)  # [BLOCK_D]
    o_ptrs = o_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# A split holds at least this many keys (fewer would spend more on the merge than they save).
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64


def choose_num_splits(batch: int, hkv: int, max_context: int, num_sms: int = 132) -> int:
    """The grid's split count (an upper bound: each sequence takes as many of them as its own
    length allows, in-kernel). 1 when (B, Hkv) alone gives two programs per SM or the context
    bound is short; else ~4 programs per SM, at most one split per MIN_SPLIT_KEYS keys of the
    bound and MAX_SPLITS.
    """
    programs = batch * hkv
    if programs >= 2 * num_sms or max_context <= 2 * MIN_SPLIT_KEYS:
        return 1
    by_occupancy = triton.cdiv(4 * num_sms, programs)
    return max(1, min(by_occupancy, max_context // MIN_SPLIT_KEYS, MAX_SPLITS))


def default_block_n(k_cache: torch.Tensor) -> int:
    """Keys per tile: 64 for an FP8 cache (the bytes in flight of a 16-bit cache's 32)."""
    return 64 if k_cache.element_size() == 1 else 32


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8 (fp8 cache only)
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, >= 1
    sm_scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.paged_decode_attention`. `num_splits` None = heuristic (each
    sequence then splits only from MIN_SPLIT_KEYS keys on); a given `num_splits` splits every
    sequence of at least that many tiles into exactly that many. `block_n` None = per dtype."""
    bsz, hq, d = q.shape
    hkv, block_size = check_cache(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens)
    assert seq_lens.shape == (bsz,)
    block_n = block_n or default_block_n(k_cache)
    min_split_tiles = 1
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size  # an upper bound, no host sync
        num_splits = choose_num_splits(bsz, hkv, max_context, num_sms(q))
        min_split_tiles = triton.cdiv(MIN_SPLIT_KEYS, block_n)
    cache = PagedCache.of(k_cache, v_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    q, precision = dot_operands(q, k_cache)
    if num_splits > 1:
        part = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part, lse = out.unsqueeze(2), out  # lse unused with one split
    group = hq // hkv
    _decode_kernel[(bsz, hkv, num_splits)](
        q,
        *cache.tensors,
        block_tables,
        seq_lens,
        part,
        lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        *cache.strides,
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        MIN_SPLIT_TILES=min_split_tiles,
        IS_FP8=cache.is_fp8,
        PRECISION=precision,
    )
    if num_splits > 1:
        _reduce_kernel[(bsz, hq)](
            part,
            lse,
            out,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(d),
        )
    return out
