"""Per-token-group FP8 activation quantization, the A side of the W8A8 GEMM.

x [M, K] -> (q [M, K] e4m3, s [M, ceil(K / 128)] fp32) with x ~= q * s per (token, group of
128 columns), s = amax / 448: what DeepSeek-V3 / Kimi K2 FP8 block checkpoints expect of
their activations (DeepSeek-V3's `act_quant`, SGLang's `per_token_group_quant_fp8`).

Bit-identical to `reference.quantize_fp8_token_groups` (tested): the divisions are
`div_rn` (IEEE round-to-nearest, as torch divides; a plain `/` lowers to an approximate
division on NVIDIA GPUs) and fp32 -> e4m3 is fp8_utils' exact round-to-nearest-even on
integer bits (the interpreter's fp8 downcast does not round to nearest-even); q is written
through a uint8 view. One program per (token, group): memory-bound, one pass over x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.fp8_utils import fp32_to_e4m3_bits
from slimserve_kernels.reference import FP8_AMAX_EPS, FP8_DTYPE, FP8_GROUP, FP8_MAX


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    mask = offs < K  # the last group may be partial
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), EPS)
    s = tl.math.div_rn(amax, FP8_MAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_qm + offs, fp32_to_e4m3_bits(q), mask=mask)
    tl.store(s_ptr + row * stride_sm + g, s)


def quantize_fp8_token_groups(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    group: int = FP8_GROUP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `reference.quantize_fp8_token_groups` -> (q [M, K] float8_e4m3fn,
    s [M, ceil(K / group)] float32)."""
    m, k = x.shape
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), x.dtype
    assert x.stride(1) == 1 and group & (group - 1) == 0, (x.stride(), group)
    q = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)
    s = torch.empty(m, triton.cdiv(k, group), device=x.device, dtype=torch.float32)
    if m == 0:
        return q, s
    grid = (m, s.shape[1])
    _act_quant_kernel[grid](
        x,
        q.view(torch.uint8),
        s,
        k,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        GROUP=group,
        FP8_MAX=FP8_MAX,
        EPS=FP8_AMAX_EPS,
        num_warps=1 if group <= 128 else 4,
    )
    return q, s
