"""Parameters of the quantized linears (Int4Linear, Fp8Linear): frozen, each with the
weight loader that copies (or slices) a checkpoint tensor into it."""

from __future__ import annotations

import torch
from torch import nn


def loaded_param(t: torch.Tensor, loader) -> nn.Parameter:
    p = nn.Parameter(t, requires_grad=False)
    p.weight_loader = loader
    return p


def copy_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.data.copy_(loaded)
