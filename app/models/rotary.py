"""Rotary position embedding (rotate-half convention, as Hugging Face Llama).

Llama, Qwen2/3, Mistral and GLM-4.5 (on the first rot_dim dims) use it; DeepSeek-V3 / Kimi
K2's MLA has its own (`mla_rope.py`, interleaved pairs by default), which keeps torch."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from slimserve_kernels import cpu_fused


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_frequencies(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling).float()
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_pos); applied to q/k of shape [T, H, D].

    One module serves every layer; the rows of the positions it is called with are gathered
    once and reused while the same positions tensor comes back (the layers of one forward).
    Callers build a new positions tensor per forward and never write one in place."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling=None):
        super().__init__()
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._rows: tuple | None = None  # (positions, cos [T, 1, D], sin [T, 1, D])

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows
        if rows is None or rows[0] is not positions:
            cos = self.cos.index_select(0, positions).unsqueeze(1)
            rows = self._rows = (positions, cos, self.sin.index_select(0, positions).unsqueeze(1))
        return rows[1], rows[2]

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, inplace: bool = False):
        """x [T, H, D] (any heads: q, k, or both side by side) -> rotated, x's dtype.

        inplace: x is the caller's own scratch (a view of a fresh projection), which may be
        overwritten: the C++ kernel (float32 CPU) then rotates it where it lies, reading the
        table rows by position (no gather), and the result is x itself."""
        if inplace and self._in_place(positions, x):
            cpu_fused.rotary_(x, positions, self.cos, self.sin)
            return x
        cos, sin = self.tables(positions)
        xf = x if x.dtype == torch.float32 else x.float()  # a no-op .float() still dispatches
        out = xf * cos + rotate_half(xf) * sin
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def _in_place(self, positions: torch.Tensor, x: torch.Tensor) -> bool:
        return (
            x.dim() == 3
            and x.stride(-1) == 1
            and x.shape[-1] == self.cos.shape[-1]
            and positions.dtype == torch.long
            and positions.is_contiguous()
            and cpu_fused.takes(x, self.cos)
        )

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)
