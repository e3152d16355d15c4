"""RoPE for Multi-head Latent Attention: YaRN scaling with DeepSeek's mscale, interleaved pairs.

Semantics follow transformers' DeepSeek-V3 reference (and DeepSeek's own code):
- YaRN inverse frequencies blend interpolated (`/ factor`) and extrapolated frequencies with a
  linear ramp between the correction dims of `beta_fast` and `beta_slow` (truncated to ints).
- cos/sin are multiplied by the attention factor `mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)` (1.0 when both are equal, as in DeepSeek-V3 and Kimi K2),
  and the softmax scale is multiplied by `mscale(factor, mscale_all_dim) ** 2`.
- `rope_interleave` (default True): dims are rotated in pairs (x0, x1), (x2, x3), ... and
  written back as [evens | odds]; q and k get the same permutation, so their dot is unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_kind(scaling: dict[str, Any] | None) -> str:
    s = scaling or {}
    return s.get("rope_type", s.get("type", "default"))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_mscale(scaling: dict[str, Any] | None) -> float:
    """Factor on the softmax scale (q.k / sqrt(d)) that YaRN's mscale_all_dim asks for."""
    if rope_kind(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def yarn_inv_freq(dim: int, base: float, s: dict[str, Any], max_pos: int) -> tuple:
    """-> (inv_freq [dim/2] float32, attention factor on cos/sin)."""
    orig = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_pos / orig
    af = s.get("attention_factor")
    if af is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        af = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else None
        af = yarn_mscale(factor) if af is None else af
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
    return inv_freq, float(af)


def mla_inv_freq(dim: int, base: float, scaling, max_pos: int) -> tuple[torch.Tensor, float]:
    kind = rope_kind(scaling)
    if kind == "yarn":
        return yarn_inv_freq(dim, base, scaling, max_pos)
    if kind == "default":
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    raise ValueError(f"unsupported rope scaling {kind!r} for MLA; supported: default, yarn")


class MLARotaryEmbedding(nn.Module):
    """Rotates q_pe [T, H, D] and k_pe [T, 1, D] at `positions` [T]."""

    def __init__(self, dim: int, max_pos: int, base: float, scaling=None, interleave=True):
        super().__init__()
        inv_freq, attention_factor = mla_inv_freq(dim, base, scaling, max_pos)
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [P, D/2]
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)
        self.interleave = interleave

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if self.interleave else xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
