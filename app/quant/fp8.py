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


def scale_rows(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]):
    """A [ceil(N/bn), ceil(K/bk)] block scale -> [N, ceil(K/bk)] float32, one row per weight
    row: what `Fp8Linear`'s scale loader takes, so every TP / merged-shard loader slices the
    scale exactly as it slices the weight. A per-channel/tensor scale -> [N, 1]."""
    n, _ = shape
    s = scale.float().reshape(-1, 1) if scale.dim() <= 1 else scale.float()
    if s.shape[0] == 1 and n > 1:  # per tensor
        return s.expand(n, s.shape[1]).contiguous()
    if block[0] == 1 or s.shape[0] == n:
        return s
    return s.repeat_interleave(block[0], 0)[:n].contiguous()


class Fp8Format:
    """FP8 block-scaled (`weight_scale_inv`) or compressed-tensors float-quantized
    (`weight_scale`, block/channel/tensor): kept FP8 (`Fp8Linear`) where the model was given
    the module (`blocks[prefix]`), dequantized to dense `weight` otherwise."""

    def __init__(self, scale_name: str, default_block, dtype=None):
        self.parts, self.marker = ("weight", scale_name), scale_name
        self.scale_name, self.default_block = scale_name, default_block
        self.dtype = dtype or torch.bfloat16
        self.blocks: dict[str, tuple[int, int]] = {}  # prefix -> checkpoint block, kept FP8

    def checkpoint_block(self, shape: tuple[int, int], scale_shape: tuple[int, ...]):
        """The checkpoint's (bn, bk) for a weight of `shape` and its scale's shape; a
        per-tensor or per-channel scale is (1, K) (`scale_rows` expands it to rows)."""
        n, k = shape
        if self.default_block is not None:
            bn, bk = self.default_block
            if tuple(scale_shape) == (-(-n // bn), -(-k // bk)):
                return (int(bn), int(bk))
        if len(scale_shape) < 2 or scale_shape[-1] == 1:
            return (1, k)
        rn, rk = scale_shape
        return (-(-n // rn), -(-k // rk))

    def convert(self, prefix: str, parts: dict, scheme=None) -> list:
        w, scale = parts["weight"], parts[self.scale_name]
        block = self.checkpoint_block(tuple(w.shape), tuple(scale.shape))
        if prefix in self.blocks:
            if w.dtype != FP8_DTYPE:
                raise ValueError(f"{prefix}.weight is {w.dtype}, expected float8_e4m3fn")
            rows = scale_rows(scale, tuple(w.shape), block)
            return [(f"{prefix}.weight", w), (f"{prefix}.weight_scale_inv", rows)]
        from app.quant.layouts import expand_scale

        if scale.dim() == 2 and scale.shape[-1] > 1:
            dense = dequantize_fp8_block(w, scale, block, self.dtype)
        else:
            dense = (w.float() * expand_scale(scale, tuple(w.shape))).to(self.dtype)
        return [(f"{prefix}.weight", dense)]
