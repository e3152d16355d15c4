"""Pieces shared by the paged decode and prefill attention kernels: the host-side contract
checks and the online-softmax update over one tile of paged keys/values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slimserve_kernels.device import fp8_tensor_cores
from slimserve_kernels.fp8_utils import e4m3_bits_to_fp16, pow2
from slimserve_kernels.reference import FP8_DTYPE, is_fp8

CACHE_DTYPES = (FP8_DTYPE, torch.bfloat16, torch.float16, torch.float32)


def dot_operands(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(q as the kernel should read it, tl.dot input precision).

    K/V tiles are cast to q's dtype for the dots; an fp32 cache upcasts q instead, so fp32
    keys are never rounded to 16 bits. fp32 dots are exact ("ieee", not tf32)."""
    if k_cache.dtype == torch.float32:
        q = q.float()
    return q, "ieee" if q.dtype == torch.float32 else "tf32"


def fp8_native(t: torch.Tensor) -> bool:
    """Whether Triton can load float8e4nv here: CPU (interpreter) and CUDA sm_89+. Older GPUs
    (A100) get the cache as uint8 bits, decoded in-kernel by `e4m3_bits_to_fp16`."""
    return not t.is_cuda or fp8_tensor_cores(t.device)


@dataclass(frozen=True)
class PagedCache:
    """The paged cache as the attention kernels take it."""

    tensors: tuple[torch.Tensor, ...]  # (k, v, k scale, v scale), as `cache_operands`
    strides: tuple[int, ...]  # (cache block, token, head; scale block, token, head)
    is_fp8: bool

    @classmethod
    def of(cls, k_cache, v_cache, k_scale, v_scale) -> PagedCache:
        tensors = cache_operands(k_cache, v_cache, k_scale, v_scale)
        fp8 = is_fp8(k_cache)
        scale_strides = k_scale.stride() if fp8 else (0, 0, 0)  # unused without FP8
        return cls(tensors, (*k_cache.stride()[:3], *scale_strides), fp8)


def cache_operands(k_cache, v_cache, k_scale, v_scale) -> tuple:
    """(k, v, k_scale, v_scale) as the attention kernels take them: a non-FP8 cache passes
    itself as the (unused) scale pointers; FP8 without native support passes uint8 views."""
    if not is_fp8(k_cache):
        return k_cache, v_cache, k_cache, v_cache
    if not fp8_native(k_cache):
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return k_cache, v_cache, k_scale, v_scale


def check_cache(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens) -> tuple[int, int]:
    """Assert the README's cache contract; returns (Hkv, block_size)."""
    hq, d = q.shape[-2:]
    num_blocks, block_size, hkv, dk = k_cache.shape
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), q.dtype
    assert k_cache.dtype in CACHE_DTYPES and v_cache.dtype == k_cache.dtype, k_cache.dtype
    assert v_cache.shape == k_cache.shape and k_cache.stride() == v_cache.stride()
    assert dk == d and hq % hkv == 0, (q.shape, k_cache.shape)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert block_tables.shape[0] == seq_lens.shape[0]
    if k_cache.dtype == FP8_DTYPE:
        assert k_scale is not None and v_scale is not None
        assert k_scale.dtype == torch.int8 and k_scale.shape == (num_blocks, block_size, hkv)
        assert v_scale.shape == k_scale.shape and v_scale.stride() == k_scale.stride()
    return hkv, block_size


@triton.jit
def _load_paged(
    cache_ptr, scale_ptr, blk, off, hkv, strides, valid, offs_d, dmask, IS_FP8: tl.constexpr
):
    """Rows [BLOCK_N, BLOCK_D] of one KV head at the given (block, offset) pairs, and their
    int8 scale exponents [BLOCK_N] (zeros for a non-FP8 cache). Offsets are int64.

    strides: (cache block, token, head; scale block, token, head), as `PagedCache.strides`."""
    stride_cb, stride_ct, stride_ch, stride_eb, stride_et, stride_eh = strides
    rows = blk * stride_cb + off * stride_ct + hkv * stride_ch  # [BLOCK_N] int64
    x = tl.load(
        cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0
    )
    if cache_ptr.dtype.element_ty == tl.uint8:  # e4m3 passed as bits (no native fp8)
        x = e4m3_bits_to_fp16(x)
    if IS_FP8:
        e = tl.load(
            scale_ptr + blk * stride_eb + off * stride_et + hkv * stride_eh, mask=valid, other=0
        ).to(tl.int32)
    else:
        e = tl.zeros(off.shape, tl.int32)
    return x, e


@triton.jit
def kv_tile_update(
    q,
    acc,
    m_i,
    l_i,
    offs_n,
    valid,
    mask,
    kv,
    qk_scale,
    offs_d,
    dmask,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online-softmax step of q [BLOCK_M, BLOCK_D] over keys at positions offs_n [BLOCK_N].

    kv: one sequence's KV head, as `attend_paged` takes it. Scores are in log2 units: qk_scale
    = sm_scale * log2(e), folded with the FP8 K descale (a power of two per key, exact) into one
    column factor, so each score takes one multiply and the softmax runs on exp2. The V
    exponent is split into the tile max (applied to the fp32 product) and a per-key remainder
    <= 1 folded into p, so p stays in [0, 1] and cannot underflow in fp16.
    """
    bt_row_ptr, cache, hkv, strides = kv
    kc_ptr, vc_ptr, ks_ptr, vs_ptr = cache
    blk = tl.load(bt_row_ptr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    off = (offs_n % BLOCK_SIZE).to(tl.int64)
    k, ek = _load_paged(kc_ptr, ks_ptr, blk, off, hkv, strides, valid, offs_d, dmask, IS_FP8)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    if IS_FP8:  # noqa: SIM108 (a compile-time branch) one factor per key column
        s = s * (qk_scale * pow2(ek))[None, :]
    else:
        s = s * qk_scale
    s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v, ev = _load_paged(vc_ptr, vs_ptr, blk, off, hkv, strides, valid, offs_d, dmask, IS_FP8)
    if IS_FP8:
        ev_max = tl.max(tl.where(valid, ev, -128), axis=0)
        p = p * pow2(tl.maximum(ev - ev_max, -126))[None, :]
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)  # [BLOCK_M, BLOCK_D]
    if IS_FP8:
        pv = pv * pow2(ev_max)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def attend_paged(
    q,
    qpos,
    rmask,
    start,
    end,
    kv,
    sm_scale,
    offs_d,
    dmask,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Attention of the query rows q [R, BLOCK_D] (rows where rmask) over the keys at
    positions start..end-1 of one sequence's KV head, BLOCK_N keys at a time.

    kv: (its block table row pointer, the cache's (k, v, k scale, v scale) pointers, the KV
    head, the cache's strides as `PagedCache.strides`).

    CAUSAL: row r sees keys up to its own position qpos[r]; else every row sees them all.
    Returns (out [R, BLOCK_D] fp32, row max m [R] in log2 units, row sum l [R]); out is 0
    where l = 0; the rows' log2-sum-exp is m + log2(l).
    """
    qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x log2 e)
    m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
    l_i = tl.zeros([q.shape[0]], tl.float32)
    acc = tl.zeros(q.shape, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        mask = rmask[:, None] & valid[None, :]
        if CAUSAL:
            mask = mask & (offs_n[None, :] <= qpos[:, None])
        acc, m_i, l_i = kv_tile_update(q, acc, m_i, l_i, offs_n, valid, mask, kv, qk_scale,
                                       offs_d, dmask, BLOCK_SIZE, IS_FP8, PRECISION)  # fmt: skip
    return acc / tl.maximum(l_i, 1e-30)[:, None], m_i, l_i
