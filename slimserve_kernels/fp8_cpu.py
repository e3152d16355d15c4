"""FP8 values on the CPU without PyTorch's per-element cast.

PyTorch converts float8 -> float on CPU one element at a time (~4 ns each): at 32 decodes it
was 36-44% of a served engine step (FP8 KV, docs/performance.md) and most of an FP8 expert's
time in the CPU fused MoE (bench/moe_cpu.py). A gather through a 256-entry table of every
bit pattern's value is ~2.5-4x faster and bit-exact, NaN codes included. Other devices keep
the cast (a GPU converts in its kernels).
"""

from __future__ import annotations

from functools import cache

import torch

from slimserve_kernels.reference import dequantize_fp8_blocks


@cache
def fp8_table(fp8: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """[256] dtype: the value of every bit pattern of the FP8 dtype `fp8`."""
    return torch.arange(256, dtype=torch.uint8).view(fp8).to(dtype)


def fp8_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) for an FP8 x (any shape), through the table on CPU."""
    if x.device.type != "cpu":
        return x.to(dtype)
    codes = x.view(torch.uint8).reshape(-1).to(torch.int32)  # index_select wants int32/64
    return fp8_table(x.dtype, dtype).index_select(0, codes).view(x.shape)


def dequantize_fp8_cpu(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
    dtype: torch.dtype,
) -> torch.Tensor:
    """`reference.dequantize_fp8_blocks` bit for bit (the same fp32 products), faster on CPU:
    the bytes go through the table, and the block scales multiply in place through a
    broadcast view instead of being expanded to a second [N, K] fp32 tensor. Blocks that do
    not tile [N, K], and other devices, take the reference."""
    n, k = weight.shape
    bn, bk = block
    if weight.device.type != "cpu" or n % bn or k % bk:
        return dequantize_fp8_blocks(weight, scale, block, dtype)
    w = fp8_values(weight, torch.float32).view(n // bn, bn, k // bk, bk)
    w.mul_(scale.float().view(n // bn, 1, k // bk, 1))
    return w.view(n, k).to(dtype)
