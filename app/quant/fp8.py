"""FP8 (e4m3) block-scaled weights, as in the DeepSeek-V3 / Kimi K2 / GLM-4.5-FP8 releases.

`weight [N, K] float8_e4m3fn` with `weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32` and
`weight_block_size = [bn, bk]` in config.json: `W[n, k] = weight[n, k] * scale_inv[n // bn,
k // bk]` (despite its name, `weight_scale_inv` multiplies).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]):
    n, k = shape
    bn, bk = block
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] | list[int],
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """weight: [N, K] fp8, scale_inv: [ceil(N/bn), ceil(K/bk)] -> [N, K] dtype."""
    n, k = weight.shape
    bn, bk = block_size
    expected = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight {n}x{k} "
            f"with weight_block_size {[bn, bk]} (expected {expected})"
        )
    s = _expand_blocks(scale_inv.float(), (n, k), (bn, bk))
    return (weight.float() * s).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, block_size: tuple[int, int] | list[int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] -> (fp8 weight [N, K], scale_inv [ceil(N/bn), ceil(K/bk)] float32)."""
    n, k = w.shape
    bn, bk = block_size
    pn, pk = math.ceil(n / bn) * bn, math.ceil(k / bk) * bk
    padded = torch.zeros(pn, pk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(pn // bn, bn, pk // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = amax / FP8_MAX
    q = (padded / _expand_blocks(scale_inv, (pn, pk), (bn, bk))).clamp(-FP8_MAX, FP8_MAX)
    return q[:n, :k].to(FP8_DTYPE), scale_inv
