"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / Kimi K2 and GLM-4.5 checkpoints.

`num_nextn_predict_layers` extra layers follow the last decoder layer in the checkpoint
(`model.layers.{L + i}`, L = num_hidden_layers). Each is a full decoder layer (attention +
MoE) with a front end that mixes the main model's hidden state at position i with the
embedding of token i + 1, and predicts token i + 2 through the shared head:

    x = eh_proj([enorm(embed(t[i+1])) ; hnorm(h[i])])     # [T, 2H] -> [T, H]
    h'[i] = decoder_layer(x)                                # its own KV cache layer
    logits = lm_head(shared_head.norm(h'[i]))

The embedding and the output head are the main model's (the checkpoint's copies under the
MTP layer, `embed_tokens` and `shared_head.head`, are the same tensors and are skipped).
h is the main model's final (normed) hidden state. Several draft tokens come from running
the same layer again on its own output hidden state and its own draft.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from app.config import ModelConfig
from app.models.layers import ReplicatedLinear, RMSNorm

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# The MTP layer's copies of the shared embedding and head (identical to the main ones).
_SHARED_COPIES = (".embed_tokens.", ".shared_head.head.")


def num_mtp_layers(cfg: ModelConfig) -> int:
    return int(cfg.raw.get("num_nextn_predict_layers") or 0)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPFrontEnd:
    """Mixed into a family's decoder layer class to make its MTP layer (names as in the
    checkpoint); the family module defines the class, so this one imports no family."""

    def init_front_end(self, cfg: ModelConfig) -> None:
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h)
        self.shared_head = SharedHead(cfg)

    def predict(self, positions, embeds, prev_hidden, attn) -> torch.Tensor:
        """embeds (of token i + 1), prev_hidden (at i): [T, H] -> h' [T, H] (pre-head)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], -1))
        return self(positions, x, attn)


class MTPHead(nn.Module):
    """The model's MTP layers, kept out of the decoder stack's forward.

    make_layer(layer index) -> an MTPFrontEnd decoder layer of the family."""

    def __init__(self, cfg: ModelConfig, make_layer: Callable[[int], nn.Module]):
        super().__init__()
        n = num_mtp_layers(cfg)
        if n == 0:
            raise ValueError(f"{cfg.architecture} checkpoint has no MTP layers")
        first = cfg.num_hidden_layers
        self.first_layer = first
        self.layers = nn.ModuleList(make_layer(first + i) for i in range(n))

    def checkpoint_name(self, name: str) -> str:
        """model.layers.{L + i}.x -> mtp.layers.{i}.x; other names unchanged."""
        m = _LAYER.match(name)
        if m is None or int(m.group(1)) < self.first_layer:
            return name
        return f"mtp.layers.{int(m.group(1)) - self.first_layer}.{name[m.end() :]}"

    def skips(self, name: str) -> bool:
        """The MTP layer's copies of the shared embedding and head are not read."""
        m = _LAYER.match(name)
        return (
            m is not None
            and int(m.group(1)) >= self.first_layer
            and any(s in name for s in _SHARED_COPIES)
        )
