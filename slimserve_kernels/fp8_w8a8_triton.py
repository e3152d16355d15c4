"""W8A8 block GEMM: y[M, N] = (A * a_scale) @ (B * b_scale).T with both operands FP8 e4m3.

A [M, K]: activations quantized per token group (`fp8_act_quant_triton.py`), one fp32 scale
per (row, GROUP = 128 columns). B [N, K]: the weight with its block scales (`SBN x SBK`,
128 x 128 for DeepSeek-V3 / Kimi K2 / GLM-4.5-FP8; 1 x K per channel; 1 x 128 for unaligned
merged shards), as in `fp8_gemm_triton.py` (W8A16).

A K tile never straddles a scale column of either operand (BLOCK_K divides GROUP and SBK, or
SBK >= K), so each K tile's partial product is scaled once, in fp32, by a_scale[row] x
b_scale[col] after the dot. The dot itself:
- `FP8_DOT=True` (sm_89+): `tl.dot` on the e4m3 operands, fp32 accumulation; FP8 tensor
  cores run it at twice the BF16 rate.
- `FP8_DOT=False`: both operands upcast to fp16 in the kernel (exact: every e4m3 value is an
  fp16 value; uint8 bits below sm_89 are decoded as in W8A16), so the scale math is the same.
  For GPUs without FP8 tensor cores, and the interpreter's default (fp16/fp32 inside the
  interpreter, quantized to FP8 on the host). The interpreter also runs `FP8_DOT=True`.
Split-K as in W8A16 (gemm_common.py) for small output grids; the output tiles are walked in
GROUP_M-row groups (`swizzled_tile`) so programs running together share operand tiles in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.device import fp8_tensor_cores, num_sms
from slimserve_kernels.fp8_act_quant_triton import quantize_fp8_token_groups
from slimserve_kernels.fp8_utils import e4m3_bits_to_fp16
from slimserve_kernels.gemm_common import (
    load_x_tile,
    split_k,
    split_k_range,
    store_split,
    swizzled_tile,
)
from slimserve_kernels.reference import FP8_DTYPE, FP8_GROUP
from slimserve_kernels.tuned import device_name, lookup, m_bucket

TABLE = "fp8_w8a8"  # slimserve_kernels/configs/fp8_w8a8/<GPU>.json, bench/fp8_gemm_sweep.py
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@triton.jit
def _upcast(t, FP8_DOT: tl.constexpr):
    """The dot's operand: e4m3 as loaded (FP8_DOT), else exactly in fp16."""
    if not FP8_DOT:
        if t.dtype == tl.uint8:  # noqa: SIM108 (a compile-time branch) e4m3 bits, below sm_89
            t = e4m3_bits_to_fp16(t)
        else:
            t = t.to(tl.float16)
    return t


@triton.jit
def _w8a8_gemm_kernel(
    a_ptr,
    as_ptr,
    b_ptr,
    bs_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_ys,
    stride_ym,
    GROUP: tl.constexpr,
    SBN: tl.constexpr,
    SBK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    offs_m, offs_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    m64, n64 = offs_m.to(tl.int64), offs_n.to(tl.int64)
    mmask, nmask = offs_m < M, offs_n < N
    as_rows = m64 * stride_asm  # [BM]
    bs_rows = (offs_n // SBN).to(tl.int64) * stride_bsn  # [BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = split_k_range(split, k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = load_x_tile(a_ptr, m64, offs_m, offs_k, M, K, stride_am)  # [BM, BK] e4m3
        bm = nmask[:, None] & (offs_k < K)[None, :]
        b = tl.load(b_ptr + n64[:, None] * stride_bn + offs_k[None, :], mask=bm, other=0.0)
        a_s = tl.load(as_ptr + as_rows + k0 // GROUP, mask=mmask, other=0.0)  # [BM]
        b_s = tl.load(bs_ptr + bs_rows + k0 // SBK, mask=nmask, other=0.0)  # [BN]
        part = tl.dot(_upcast(a, FP8_DOT), tl.trans(_upcast(b, FP8_DOT)), out_dtype=tl.float32)
        acc += part * a_s[:, None] * b_s[None, :]
    store_split(y_ptr, acc, m64, offs_m, offs_n, split, M, N, stride_ys, stride_ym)


def table_key(m: int, n: int, k: int) -> tuple[int, int, int]:
    """The tuned table's key: (M bucket, N, K); 128 x 128 weight scale blocks."""
    return (m_bucket(m, M_BUCKETS), n, k)


def choose_config(m: int, n: int, k: int, sbk: int, num_sms: int = 132,
                  device: str = "cpu") -> dict:  # fmt: skip
    """Tiles and split-K: this GPU's tuned table (128 x 128 scale blocks), else a fixed rule
    (the one the CPU tests run). BLOCK_K = 128: FP8 dots want long K tiles (32 bytes of K per
    MMA k-step), and each K step then applies one scale pair of the 128 x 128 checkpoints.
    The rule's tiles compile without spills for sm_90 (tests/kernels/gpu_compile.py)."""
    bk = next((b for b in (128, 64, 32) if sbk % b == 0 or sbk >= k), None)
    assert bk is not None, f"weight scale blocks of {sbk} columns: not a multiple of 32"
    tuned = lookup(TABLE, device, table_key(m, n, k)) if bk == 128 else None
    if tuned is not None:
        return tuned
    if m <= 64:
        bm, bn, warps = (16 if m <= 16 else 32 if m <= 32 else 64), 64, 4
    else:
        bm, bn, warps = 128, 128, 8
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    cfg["split_k"] = split_k(tiles, triton.cdiv(k, bk), num_sms)  # few tiles: split K
    return cfg


def fp8_dot_native(t: torch.Tensor) -> bool:
    """FP8 tensor cores: sm_89 (Ada) and sm_90 (Hopper) on. CPU: the interpreter, which runs
    FP8 dots too, but the tests pick the path explicitly."""
    return fp8_tensor_cores(t.device)


def _operand(t: torch.Tensor, native: bool) -> torch.Tensor:
    """float8e4nv where the GPU has native FP8 (and on CPU), uint8 bits below sm_89."""
    return t.view(torch.uint8) if t.is_cuda and not native else t


def fp8_block_gemm(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, ceil(K / group)] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / SBN), ceil(K / SBK)] float32
    block: tuple[int, int],  # (SBN, SBK)
    out_dtype: torch.dtype,
    group: int = FP8_GROUP,
    config: dict | None = None,
    fp8_dot: bool | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fp8_block_gemm`. `fp8_dot`: the dot on FP8 operands (default:
    where the GPU has FP8 tensor cores; False on CPU); `config` overrides `choose_config`."""
    m, k = a.shape
    n = weight.shape[0]
    sbn, sbk = block
    assert a.dtype == FP8_DTYPE and weight.dtype == FP8_DTYPE, (a.dtype, weight.dtype)
    assert weight.shape == (n, k) and a_scale.shape == (m, triton.cdiv(k, group)), a_scale.shape
    assert scale.shape == (triton.cdiv(n, sbn), triton.cdiv(k, sbk)), (scale.shape, block)
    assert a_scale.dtype == scale.dtype == torch.float32
    assert a.stride(1) == weight.stride(1) == a_scale.stride(1) == scale.stride(1) == 1
    assert out_dtype in (torch.float16, torch.bfloat16, torch.float32), out_dtype
    native = fp8_dot_native(a)
    fp8_dot = native if fp8_dot is None else fp8_dot
    assert native or not (fp8_dot and a.is_cuda), "FP8 dots need compute capability >= 8.9"
    if m == 0:
        return torch.empty(0, n, device=a.device, dtype=out_dtype)
    cfg = config or choose_config(m, n, k, sbk, num_sms(a), device_name(a))
    bk = cfg["BLOCK_K"]
    assert group % bk == 0 and (sbk % bk == 0 or sbk >= k), "a K tile may straddle a scale"
    splits = cfg["split_k"]
    y = torch.empty(splits, m, n, device=a.device, dtype=torch.float32 if splits > 1 else out_dtype)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    _w8a8_gemm_kernel[grid](
        _operand(a, native),
        a_scale,
        _operand(weight, native),
        scale,
        y,
        m,
        n,
        k,
        k_per_split,
        a.stride(0),
        a_scale.stride(0),
        weight.stride(0),
        scale.stride(0),
        y.stride(0),
        y.stride(1),
        GROUP=group,
        SBN=sbn,
        SBK=sbk,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=bk,
        GROUP_M=cfg.get("GROUP_M", 8),
        FP8_DOT=fp8_dot,
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),  # Triton's default on CUDA; no-op interpreted
    )
    return y[0] if splits == 1 else y.sum(0).to(out_dtype)


def fp8_w8a8_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / SBN), ceil(K / SBK)] float32
    block: tuple[int, int],  # (SBN, SBK)
    config: dict | None = None,
    fp8_dot: bool | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fp8_w8a8_gemm`: quantize x per token group (one pass over x),
    then the W8A8 block GEMM -> [M, N] x.dtype."""
    q, s = quantize_fp8_token_groups(x)
    return fp8_block_gemm(q, s, weight, scale, block, x.dtype, config=config, fp8_dot=fp8_dot)
