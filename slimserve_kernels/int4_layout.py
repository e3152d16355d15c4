"""The K-major INT4 layout the W4A16 GEMV / split-K GEMM kernels read (`int4_kn_triton.py`),
made from the canonical one at load time, and its PyTorch reference. No Triton import.

Canonical (checkpoints, `app/quant`): `qweight [N, K/8] int32`, nibble i of word j = column
8j + i; `scales [N, K/g]`; `zeros [N, K/g]` integer domain or None (= 8).

K-major ("kn"): the same words transposed, `qweight_t [K/8, N]` (row j holds K indices
8j..8j+7 of every output column, so a warp's load of one word row is contiguous along N),
`scales_t [K/g, N]`, and the zero points pre-multiplied, `zs_t = -z * s` in fp32, so
dequantization is one FMA: `W[k, n] = q * s + zs`. A symmetric weight has no `zs_t`: the kernel
forms `-8 * s` once per scale load. The nibble order is unchanged, so `qweight_t` is a
transpose and no nibble moves: `qweight_t.T` is a valid canonical `qweight` (column-major),
which lets a layer keep one copy of the words for both layouts (`column_major`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve_kernels.reference import unpack_int4

SYM_ZERO = 8


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] with the same values, stored column-major (t.T is contiguous); a view if
    already so. A canonical qweight / scales kept this way serves the kn layout with no copy."""
    return t if t.T.is_contiguous() else t.T.contiguous().T


@dataclass(frozen=True)
class Int4KN:
    """One [N, K] INT4 weight in the kernels' K-major layout."""

    qweight_t: torch.Tensor  # [K/8, N] int32, contiguous
    scales_t: torch.Tensor  # [K/g, N], contiguous, the checkpoint's dtype
    zs_t: torch.Tensor | None  # [K/g, N] fp32 = -z * s; None when symmetric (z = 8)
    group_size: int

    def __post_init__(self):
        kw, n = self.qweight_t.shape
        g = self.group_size
        assert self.qweight_t.dtype == torch.int32 and self.qweight_t.is_contiguous()
        assert (kw * 8) % g == 0 and self.scales_t.shape == (kw * 8 // g, n), self.scales_t.shape
        assert self.scales_t.is_contiguous()
        if self.zs_t is not None:
            assert self.zs_t.shape == self.scales_t.shape and self.zs_t.dtype == torch.float32
            assert self.zs_t.is_contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight."""
        return self.qweight_t.shape[1], self.qweight_t.shape[0] * 8

    @classmethod
    def of(cls, qweight, scales, zeros, group_size: int) -> Int4KN:
        """From the canonical layout; no copy of the words or scales when they are column-major
        (`column_major`), else one transpose each."""
        zs = None
        if zeros is not None:
            zs = (-zeros.float() * scales.float()).T.contiguous()
        return cls(qweight.T.contiguous(), scales.T.contiguous(), zs, group_size)


def dequantize_kn(w: Int4KN, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W.T [K, N] in dtype, computed as the kernels do: q * s + zs in fp32."""
    g = w.group_size
    q = unpack_int4(w.qweight_t.T).T.float()  # [K, N]
    s = w.scales_t.float().repeat_interleave(g, dim=0)
    zs = -SYM_ZERO * s if w.zs_t is None else w.zs_t.repeat_interleave(g, dim=0)
    return (q * s + zs).to(dtype)


def int4_gemm_kn(x: torch.Tensor, w: Int4KN) -> torch.Tensor:
    """Reference: y [M, N] = x [M, K] @ W.T, W from the kn layout (fp32 math, x's dtype out)."""
    return (x.float() @ dequantize_kn(w)).to(x.dtype)
