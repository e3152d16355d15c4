"""GLM-4.5 / 4.6 / 4.5-Air (`Glm4MoeForCausalLM`): GQA with partial rotary + MoE.

Attention is Llama's (qkv bias and q/k RMSNorm as configured) with RoPE on the first
`partial_rotary_factor * head_dim` dims of each head (rotate-half within that slice, as the
transformers reference); the rest of the head passes through. MLP layers: see moe.py.
"""

from __future__ import annotations

import torch
from torch import nn

from app.config import ModelConfig
from app.models.llama import LlamaAttention
from app.models.moe import MoECausalLM
from app.models.parallel import TPContext
from app.models.rotary import RotaryEmbedding


def partial_rotary_factor(cfg: ModelConfig) -> float:
    """config.json keeps it top-level (transformers 4) or in rope_parameters (5)."""
    raw = cfg.raw
    params = raw.get("rope_parameters") or {}
    return float(raw.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)


class PartialRotaryEmbedding(nn.Module):
    """Applies RoPE to q/k[..., :rot_dim] and leaves the rest: q, k [T, H, D]."""

    def __init__(self, head_dim: int, factor: float, max_pos: int, theta: float, scaling=None):
        super().__init__()
        self.rot_dim = int(head_dim * factor)
        assert self.rot_dim % 2 == 0 and 0 < self.rot_dim <= head_dim, "bad partial rotary"
        self.rotary = RotaryEmbedding(self.rot_dim, max_pos, theta, scaling)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor, inplace: bool = False):
        """inplace: as RotaryEmbedding.rotate (x may be overwritten; then no copy of the rest)."""
        r = self.rot_dim
        head = x[..., :r]
        rotated = self.rotary.rotate(positions, head, inplace)
        return x if rotated is head else torch.cat((rotated, x[..., r:]), -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return self.rotate(positions, q), self.rotate(positions, k)


class Glm4MoeForCausalLM(MoECausalLM):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        **MoECausalLM.packed_modules_mapping,
    }

    def make_attention(self, cfg: ModelConfig, layer: int, tp: TPContext) -> nn.Module:
        if not hasattr(self, "rotary"):  # one table for all layers
            self.rotary = PartialRotaryEmbedding(
                cfg.head_dim,
                partial_rotary_factor(cfg),
                cfg.max_position_embeddings,
                cfg.rope_theta,
                cfg.rope_scaling,
            )
        return LlamaAttention(cfg, layer, tp, self.rotary)
