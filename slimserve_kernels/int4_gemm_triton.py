"""W4A16 GEMM: y[M, N] = x[M, K] @ W.T with W unpacked on the fly from int32 words.

Packing (README.md here): nibble i of qweight[n, j] is W's column 8j + i, unsigned 0..15,
W[n, k] = (q - z[n, k // g]) * s[n, k // g], z = 8 when symmetric.

Three paths (`choose_config`):
- GEMV (M <= 4, decode): each packed word is loaded once and unpacked in registers to
  [BLOCK_N, BLOCK_K/8, 8]; a multiply-reduce per activation row, no `tl.dot` (which would pad
  M to 16); split along K so N / BLOCK_N programs do not starve the GPU; split partials are
  summed in fp32.
- Tiled (4 < M < 1024): [BLOCK_M, BLOCK_N] output tiles with `tl.dot` over K, split-K when
  the tile grid alone is too small to fill the GPU.
- Dequant (M >= 1024, prefill): W dequantized once by `_dequant_kernel`, then cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.device import DEQUANT_MIN_M, num_sms
from slimserve_kernels.gemm_common import (
    load_x_tile,
    output_tile,
    split_k,
    split_k_range,
    store_split,
)


@triton.jit
def _unpack_words(
    weight, strides, offs_n, words_k, N, K, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr
):
    """W at rows offs_n [BN] and packed-word columns words_k [BK/8] -> fp32 [BN, BK/8, 8],
    element [n, j, i] = W[n, 8 * words_k[j] + i]; out-of-range entries are 0.

    Each int32 word, scale and zero point is loaded once per tile (a word never straddles a
    group) and unpacked in registers. weight: (packed int32, scales, zero points) pointers;
    strides: their row strides."""
    w_ptr, s_ptr, z_ptr = weight
    stride_wn, stride_sn, stride_zn = strides
    mask = (offs_n < N)[:, None] & (words_k < K // 8)[None, :]
    rows = offs_n.to(tl.int64)[:, None]
    words = tl.load(w_ptr + rows * stride_wn + words_k[None, :], mask=mask, other=0)
    g = ((words_k * 8) // GROUP)[None, :]
    s = tl.load(s_ptr + rows * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(z_ptr + rows * stride_zn + g, mask=mask, other=0).to(tl.float32)
    else:
        z = tl.full(s.shape, 8.0, tl.float32)
    q = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BN, BK/8, 8]
    return q.to(tl.float32) * s[:, :, None] - (z * s)[:, :, None]


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_ys,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K // 8)  # packed word within the K tile
    offs_i = tl.arange(0, 8)  # nibble within the word
    weight, w_strides = (w_ptr, s_ptr, z_ptr), (stride_wn, stride_sn, stride_zn)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = split_k_range(split, k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words_k = k0 // 8 + offs_j  # [BK/8]
        w = _unpack_words(weight, w_strides, offs_n, words_k, N, K, GROUP, HAS_ZEROS)
        cols = (words_k * 8)[:, None] + offs_i[None, :]  # [BK/8, 8] column k of each nibble
        for m in tl.static_range(BLOCK_M):
            k_lim = tl.where(m < M, K, 0)  # rows past M (BLOCK_M padding) read nothing
            x = tl.load(x_ptr + m * stride_xm + cols, mask=cols < k_lim, other=0.0)
            part = tl.sum(tl.sum(w * x.to(tl.float32)[None, :, :], axis=2), axis=1)  # [BN]
            acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    store_split(y_ptr, acc, offs_m, offs_m, offs_n, split, M, N, stride_ys, stride_ym)


@triton.jit
def _tiled_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_ys,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, split = output_tile(BLOCK_M, BLOCK_N)
    m64 = offs_m.to(tl.int64)
    weight, w_strides = (w_ptr, s_ptr, z_ptr), (stride_wn, stride_sn, stride_zn)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = split_k_range(split, k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        x = load_x_tile(x_ptr, m64, offs_m, k0 + tl.arange(0, BLOCK_K), M, K, stride_xm)
        words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w = _unpack_words(weight, w_strides, offs_n, words_k, N, K, GROUP, HAS_ZEROS)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])  # row-major: column 8j + i, as packed
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    store_split(y_ptr, acc, m64, offs_m, offs_n, split, M, N, stride_ys, stride_ym)


@triton.jit
def _dequant_kernel(
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_on,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words_k = tl.program_id(1) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    weight, w_strides = (w_ptr, s_ptr, z_ptr), (stride_wn, stride_sn, stride_zn)
    w = _unpack_words(weight, w_strides, offs_n, words_k, N, K, GROUP, HAS_ZEROS)  # [BN, BK/8, 8]
    cols = (words_k * 8)[:, None] + tl.arange(0, 8)[None, :]  # [BK/8, 8]
    mask = (offs_n < N)[:, None, None] & (cols < K)[None, :, :]
    o_ptrs = out_ptr + offs_n.to(tl.int64)[:, None, None] * stride_on + cols[None, :, :]
    tl.store(o_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(qweight, scales, zeros, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """qweight [N, K // 8] -> W [N, K] in dtype (one pass, for the dequant-then-cuBLAS path)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    out = torch.empty(n, k, device=qweight.device, dtype=dtype)
    z = zeros if zeros is not None else scales
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 64))
    _dequant_kernel[grid](
        qweight,
        scales,
        z,
        out,
        n,
        k,
        qweight.stride(0),
        scales.stride(0),
        z.stride(0),
        out.stride(0),
        GROUP=group_size,
        HAS_ZEROS=zeros is not None,
        BLOCK_N=64,
        BLOCK_K=64,
    )
    return out


GEMV_MAX_M = 4


def choose_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Block sizes and split-K for one problem (a fixed table, not autotuned, so CPU tests
    pin exactly the configs the GPU runs)."""
    if m >= DEQUANT_MIN_M:
        return dict(path="dequant", split_k=1)
    if m <= GEMV_MAX_M:
        # From an H200 sweep (bench/int4_gemv_sweep.py, bench/results/int4_gemv_sweep.json):
        # 32-wide N tiles, 128 / BM of K and the widest split-K swept (16) were fastest at 6 of
        # 8 (M, K, N) points (the other two, 4096 x 4096, ran first, while the clocks ramped
        # up), 1.2-1.4x the first, GPU-less table; the kernel still reads only ~8% of HBM
        # bandwidth, below cuBLAS BF16 (slimserve_kernels/README.md).
        bm = triton.next_power_of_2(m)  # the [BM, BN, BK] product must fit in registers
        bk = 128 // bm
        splits = max(1, min(16, triton.cdiv(k, bk)))
        return dict(path="gemv", BLOCK_M=bm, BLOCK_N=32, BLOCK_K=bk, split_k=splits)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    # Chosen so sm_90 cubins do not spill (cuobjdump): <= 254 registers, no stack.
    big = dict(BLOCK_N=128, BLOCK_K=32, num_warps=8)
    cfg = dict(path="tiled", BLOCK_M=bm, **(big if bm == 128 else dict(BLOCK_N=64, BLOCK_K=64)))
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, cfg["BLOCK_N"])
    cfg["split_k"] = split_k(tiles, triton.cdiv(k, cfg["BLOCK_K"]), num_sms)
    return cfg


def int4_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # [N, K // 8] int32
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor | None,  # [N, K // group_size] integer domain; None = 8 (symmetric)
    group_size: int,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.int4_gemm`; `config` overrides `choose_config` (tests)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert qweight.dtype == torch.int32 and qweight.shape == (n, k // 8) and k % 8 == 0
    assert group_size in (32, 64, 128) and k % group_size == 0, (k, group_size)
    assert scales.shape == (n, k // group_size), scales.shape
    assert zeros is None or zeros.shape == scales.shape, zeros.shape
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1
    assert zeros is None or zeros.stride(1) == 1
    cfg = config or choose_config(m, n, k, num_sms(x))
    if cfg["path"] == "dequant":
        w = dequantize_int4(qweight, scales, zeros, group_size, x.dtype)  # [N, K]
        return torch.matmul(x, w.T)
    y = torch.empty(cfg["split_k"], m, n, device=x.device, dtype=torch.float32)
    if cfg["split_k"] == 1:
        y = torch.empty(1, m, n, device=x.device, dtype=x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg["split_k"]), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    z = zeros if zeros is not None else scales
    args = (
        x,
        qweight,
        scales,
        z,
        y,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        z.stride(0),
        y.stride(0),
        y.stride(1),
    )
    meta = dict(
        GROUP=group_size,
        HAS_ZEROS=zeros is not None,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
    )
    if cfg["path"] == "gemv":
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["split_k"])
        _gemv_kernel[grid](*args, **meta, num_warps=cfg.get("num_warps", 4))
    else:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), cfg["split_k"])
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        _tiled_kernel[grid](*args, **meta, PRECISION=prec, num_warps=cfg.get("num_warps", 4))
    return y[0] if cfg["split_k"] == 1 else y.sum(0).to(x.dtype)
