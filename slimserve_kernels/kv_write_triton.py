"""Fused KV-cache write: quantize new K/V to FP8 (power-of-two per-token-head scale) and
scatter them into their paged-cache slots, one program per (token, KV head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.fp8_utils import fp8_scale_exponent, fp32_to_e4m3_bits, pow2
from slimserve_kernels.reference import is_fp8


@triton.jit
def _write_one(
    src_ptr, cache, t, h, slot, D, src_strides, strides, IS_FP8: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Token t, head h of src (row strides src_strides) into `slot` of cache: (cache, scale)
    pointers; strides: (cache slot, head; scale slot, head)."""
    cache_ptr, scale_ptr = cache
    stride_st, stride_sh = src_strides
    stride_cslot, stride_ch, stride_eslot, stride_eh = strides
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(src_ptr + t * stride_st + h * stride_sh + offs_d, mask=mask, other=0.0)
    x = x.to(tl.float32)  # [BLOCK_D]
    dst = cache_ptr + slot * stride_cslot + h * stride_ch + offs_d
    if IS_FP8:
        e = fp8_scale_exponent(tl.max(tl.abs(x), axis=0))
        y = tl.minimum(tl.maximum(x * pow2(-e), -448.0), 448.0)
        tl.store(dst, fp32_to_e4m3_bits(y), mask=mask)
        tl.store(scale_ptr + slot * stride_eslot + h * stride_eh, e.to(tl.int8))
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    D,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cslot,
    stride_ch,
    stride_eslot,
    stride_eh,
    IS_FP8: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)  # int64: block_id * block_size + offset
    if slot >= 0:
        strides = (stride_cslot, stride_ch, stride_eslot, stride_eh)
        k_strides, v_strides = (stride_kt, stride_kh), (stride_vt, stride_vh)
        _write_one(k_ptr, (kc_ptr, ks_ptr), t, h, slot, D, k_strides, strides, IS_FP8, BLOCK_D)
        _write_one(v_ptr, (vc_ptr, vs_ptr), t, h, slot, D, v_strides, strides, IS_FP8, BLOCK_D)


def kv_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8 (fp8 cache only)
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,  # [T] int64; <0 = skip
) -> None:
    """Triton twin of `reference.kv_write` (same signature, same bits)."""
    t, hkv, d = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (t,), (k.shape, v.shape)
    assert slot_mapping.dtype == torch.int64
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (hkv, d), k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    fp8 = is_fp8(k_cache)
    if t == 0:
        return
    # Slots index a flat [num_blocks * block_size] view: the two leading dims must merge.
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    if fp8:
        assert k_scale is not None and v_scale is not None and k_scale.dtype == torch.int8
        assert k_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
        assert k_scale.stride(0) == k_scale.shape[1] * k_scale.stride(1)
        kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        ks, vs, es = k_scale, v_scale, (k_scale.stride(1), k_scale.stride(2))
    else:
        kc, vc, ks, vs, es = k_cache, v_cache, k_cache, v_cache, (0, 0)
    _kv_write_kernel[(t, hkv)](
        k,
        v,
        kc,
        vc,
        ks,
        vs,
        slot_mapping,
        d,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        es[0],
        es[1],
        IS_FP8=fp8,
        BLOCK_D=triton.next_power_of_2(d),
    )
