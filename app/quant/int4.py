"""INT4 weight quantization in the kernels' canonical packed layout, RTN and GPTQ.

Layout (slimserve_kernels/README.md): `qweight [N, K/8] int32`, nibble i (bits 4i..4i+3) of word j
holds column 8j + i as an unsigned 0..15; `scales [N, K/g]`; `zeros [N, K/g]` in the integer
domain (uint8 0..15) or `None`, meaning 8 (symmetric). `W[n, k] = (q - z) * s` per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slimserve_kernels.reference import unpack_int4

GROUP_SIZES = (32, 64, 128)
QMAX = 15
SYM_ZERO = 8


@dataclass(slots=True)
class Int4Weight:
    """One quantized [N, K] weight matrix."""

    qweight: torch.Tensor  # [N, K/8] int32
    scales: torch.Tensor  # [N, K/g] float
    zeros: torch.Tensor | None  # [N, K/g] uint8 in 0..15, None = 8 (symmetric)
    group_size: int

    def __post_init__(self):
        n, k = self.shape
        assert self.qweight.dtype == torch.int32, "qweight must be int32"
        assert k % self.group_size == 0, f"K={k} is not a multiple of group {self.group_size}"
        assert self.scales.shape == (n, k // self.group_size), "scales must be [N, K/g]"
        assert self.zeros is None or self.zeros.shape == self.scales.shape, "zeros != scales"

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 8

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def codes(self) -> torch.Tensor:
        """Unsigned codes [N, K] uint8."""
        return unpack_int4(self.qweight)

    def zeros_or_default(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, SYM_ZERO, dtype=torch.uint8, device=self.scales.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] dense weight."""
        g = self.group_size
        q = self.codes().float()
        z = self.zeros_or_default().float().repeat_interleave(g, dim=1)
        s = self.scales.float().repeat_interleave(g, dim=1)
        return ((q - z) * s).to(dtype)

    def rows(self, start: int, size: int) -> Int4Weight:
        """Output rows start..start+size (e.g. the q part of a merged qkv weight)."""
        z = None if self.zeros is None else self.zeros[start : start + size]
        sl = slice(start, start + size)
        return Int4Weight(self.qweight[sl], self.scales[sl], z, self.group_size)

    def nbytes(self) -> int:
        zeros = 0 if self.zeros is None else _packed_zero_bytes(self.zeros)
        return self.qweight.nbytes + self.scales.nbytes + zeros


def _packed_zero_bytes(zeros: torch.Tensor) -> int:
    # Checkpoints store zero points packed 8 per int32 (compressed-tensors, GPTQ, AWQ).
    return math.ceil(zeros.shape[0] / 8) * zeros.shape[1] * 4


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [N, K] integers in 0..15 -> [N, K/8] int32 (nibble i of word j = column 8j + i)."""
    n, k = q.shape
    assert k % 8 == 0, f"K={k} must be a multiple of 8"
    assert int(q.min()) >= 0 and int(q.max()) <= QMAX, "codes must lie in 0..15"
    nib = q.to(torch.int32).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    # Bitwise OR of disjoint nibbles == their sum; int32 wraps for the top nibble as intended.
    return (nib << shifts).sum(dim=-1, dtype=torch.int32)


def group_params(
    w: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., g] one group per row -> (scale [...], zero [...] float in 0..15).

    The range always includes 0 (so zero is exact). Symmetric: s = amax / 7.5, z = 8, so
    codes -8..7 cover [-amax, amax] with |error| <= s/2. Asymmetric: s = (max - min) / 15,
    z = round(-min / s). The scale is rounded (up) to `scale_dtype` first so that the codes
    are chosen against the scale that is actually stored and the bound still holds.
    """
    w = w.float()
    lo = w.amin(dim=-1).clamp(max=0)
    hi = w.amax(dim=-1).clamp(min=0)
    scale = torch.maximum(-lo, hi) / 7.5 if symmetric else (hi - lo) / QMAX
    stored = scale.to(scale_dtype)
    # Round the stored scale up, never down, so the grid still spans the group's range.
    up = torch.nextafter(stored, torch.full_like(stored, float("inf")))
    scale = torch.where(stored.float() < scale, up, stored).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    if symmetric:
        zero = torch.full_like(scale, SYM_ZERO)
    else:
        zero = torch.round(-lo / scale).clamp(0, QMAX)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w: [..., g], scale/zero: [...] -> float codes in 0..15."""
    return torch.clamp(torch.round(w.float() / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, QMAX)


def check_grouping(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype | None):
    """Validates w: [N, K] against group_size; returns the scale dtype (w's unless given)."""
    k = w.shape[1]
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    return scale_dtype or (w.dtype if w.dtype.is_floating_point else torch.float32)


def quantize_rtn(
    w: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    scale_dtype: torch.dtype | None = None,
) -> Int4Weight:
    """Round-to-nearest group-wise INT4 of w: [N, K]. Scales take w's dtype unless given."""
    n, k = w.shape
    scale_dtype = check_grouping(w, group_size, scale_dtype)
    wg = w.float().view(n, k // group_size, group_size)
    scale, zero = group_params(wg, symmetric, scale_dtype)
    q = quantize_codes(wg, scale, zero).view(n, k)
    zeros = None if symmetric else zero.to(torch.uint8)
    return Int4Weight(pack_int4(q), scale.to(scale_dtype), zeros, group_size)


def quantization_error(w: torch.Tensor, qw: Int4Weight, x: torch.Tensor | None = None) -> float:
    """Relative Frobenius error of the weight, or of the layer output on inputs x: [M, K]."""
    w = w.float()
    wq = qw.dequantize(torch.float32)
    if x is None:
        return float((w - wq).norm() / w.norm())
    ref = x.float() @ w.T
    return float((ref - x.float() @ wq.T).norm() / ref.norm())
