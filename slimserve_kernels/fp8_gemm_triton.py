"""W8A16 GEMM: y[M, N] = x[M, K] @ W.T with W FP8 e4m3 and block scales, dequantized in-kernel.

`W[n, k] = w[n, k] * scale[n // SBN, k // SBK]` (`weight_scale_inv` of DeepSeek-V3 style
checkpoints: despite its name it multiplies). Scale blocks: 128x128 (DeepSeek-V3, Kimi K2,
GLM-4.5-FP8, `weight_quant="fp8"`), 1 x K (per output channel), 1 x 128 (a block checkpoint
whose merged shards do not align to 128 rows, app/quant/fp8_linear.py).

One tiled kernel with `tl.dot` over K. A K tile never straddles a scale column (BLOCK_K
divides SBK, or SBK >= K), so the scale is one value per output row per K tile, applied to
the fp32 partial product after the dot (exact e4m3 -> fp16/bf16 upcast before it), not to
every weight element. Split-K fills the GPU when the output tile grid is small (decode).
From M = 1024 on (prefill) W is dequantized once by `_fp8_dequant_kernel` (one pass: 1 byte
read, 2 written per weight, bit for bit `reference.dequantize_fp8_blocks`) and cuBLAS runs
(`DEQUANT_MIN_M`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.device import DEQUANT_MIN_M, fp8_tensor_cores, num_sms
from slimserve_kernels.fp8_utils import e4m3_bits_to_fp16, fp32_to_bf16_rne
from slimserve_kernels.gemm_common import (
    load_x_tile,
    output_tile,
    split_k,
    split_k_range,
    store_split,
)
from slimserve_kernels.reference import FP8_DTYPE


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ys,
    stride_ym,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n, split = output_tile(BLOCK_M, BLOCK_N)
    m64, n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    nmask = offs_n < N
    s_rows = (offs_n // SBN).to(tl.int64) * stride_sn  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = split_k_range(split, k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_x_tile(x_ptr, m64, offs_m, offs_k, M, K, stride_xm)
        wm = nmask[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + n64[:, None] * stride_wn + offs_k[None, :], mask=wm, other=0.0)
        if w_ptr.dtype.element_ty == tl.uint8:  # e4m3 bits (GPUs without native fp8)
            w = e4m3_bits_to_fp16(w)
        s = tl.load(s_ptr + s_rows + k0 // SBK, mask=nmask, other=0.0).to(tl.float32)  # [BN]
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        acc += part * s[None, :]
    store_split(y_ptr, acc, m64, offs_m, offs_n, split, M, N, stride_ys, stride_ym)


@triton.jit
def _fp8_dequant_kernel(
    w_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_on,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_SCALE_COLUMN: tl.constexpr,  # the tile's K range lies in one scale column
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n64 = offs_n.to(tl.int64)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.load(w_ptr + n64[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    if w_ptr.dtype.element_ty == tl.uint8:  # e4m3 bits (GPUs without native fp8)
        w = e4m3_bits_to_fp16(w)
    s_rows = s_ptr + (offs_n // SBN).to(tl.int64) * stride_sn  # [BN]
    if ONE_SCALE_COLUMN:  # one scale per row of the tile (128 x 128 blocks, per channel)
        s = tl.load(s_rows + k0 // SBK, mask=offs_n < N, other=0.0)[:, None]  # [BN, 1]
    else:  # a scale per (row, column) of the tile (narrow K blocks)
        s = tl.load(s_rows[:, None] + (offs_k // SBK)[None, :], mask=mask, other=0.0)
    # fp32 product, one rounding to the output dtype: the reference's `(w.float() * s).to()`
    out = w.to(tl.float32) * s
    if out_ptr.dtype.element_ty == tl.bfloat16:
        out = fp32_to_bf16_rne(out)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n64[:, None] * stride_on + offs_k[None, :], out, mask=mask)


def dequantize_fp8(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / SBN), ceil(K / SBK)] float32
    block: tuple[int, int],  # (SBN, SBK)
    dtype: torch.dtype,
) -> torch.Tensor:
    """Triton twin of `reference.dequantize_fp8_blocks` -> [N, K] dtype, in one pass (the
    reference's PyTorch ops make several full-size fp32 passes: on an H100 the prefill path
    built on them took 5x cuBLAS BF16's time at 1,024 tokens)."""
    n, k = weight.shape
    assert scale.dtype == torch.float32 and scale.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(n, k, device=weight.device, dtype=dtype)
    bn, bk = 64, 128
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _fp8_dequant_kernel[grid](
        _fp8_operand(weight),
        scale,
        out,
        n,
        k,
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        SBN=block[0],
        SBK=block[1],
        BLOCK_N=bn,
        BLOCK_K=bk,
        ONE_SCALE_COLUMN=block[1] % bk == 0 or block[1] >= k,
    )
    return out


def choose_config(m: int, n: int, k: int, sbk: int, num_sms: int = 132) -> dict:
    """Tiles and split-K for one problem: a fixed table (not autotuned), so the CPU tests run
    the configs the GPU runs. BLOCK_K divides the scale block along K. The tiles are the
    largest that compile without register spills for sm_90 (tests/kernels/gpu_compile.py);
    not timed on a GPU yet."""
    if m >= DEQUANT_MIN_M:
        return dict(path="dequant", split_k=1)
    bk = 64 if sbk % 64 == 0 or sbk >= k else 32
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    cfg = dict(path="tiled", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk, num_warps=4 if bm <= 32 else 8)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, 64)
    cfg["split_k"] = split_k(tiles, triton.cdiv(k, bk), num_sms)
    return cfg


def _fp8_operand(w: torch.Tensor) -> torch.Tensor:
    """Native float8e4nv on CPU (interpreter) and sm_89+; uint8 bits on older GPUs."""
    if w.is_cuda and not fp8_tensor_cores(w.device):
        return w.view(torch.uint8)
    return w


def fp8_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / SBN), ceil(K / SBK)] float32
    block: tuple[int, int],  # (SBN, SBK)
    config: dict | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fp8_gemm`; `config` overrides `choose_config` (tests)."""
    m, k = x.shape
    n = weight.shape[0]
    sbn, sbk = block
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert weight.dtype == FP8_DTYPE and weight.shape == (n, k), (weight.dtype, weight.shape)
    assert scale.shape == (triton.cdiv(n, sbn), triton.cdiv(k, sbk)), (scale.shape, block)
    assert scale.dtype == torch.float32 and scale.stride(1) == 1
    assert x.stride(1) == 1 and weight.stride(1) == 1
    cfg = config or choose_config(m, n, k, sbk, num_sms(x))
    if cfg["path"] == "dequant":  # prefill: one dequantization, then cuBLAS
        return torch.matmul(x, dequantize_fp8(weight, scale, block, x.dtype).T)
    assert sbk % cfg["BLOCK_K"] == 0 or sbk >= k, "a K tile may not straddle a scale block"
    splits = cfg["split_k"]
    y = torch.empty(splits, m, n, device=x.device, dtype=torch.float32 if splits > 1 else x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _fp8_gemm_kernel[grid](
        x,
        _fp8_operand(weight),
        scale,
        y,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        scale.stride(0),
        y.stride(0),
        y.stride(1),
        SBN=sbn,
        SBK=sbk,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.get("num_warps", 4),
    )
    return y[0] if splits == 1 else y.sum(0).to(x.dtype)
