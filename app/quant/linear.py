"""`QuantizedLinear`: what `Fp8Linear` and `Int4Linear` share, the role of the layer they
replace (tensor-parallel reduce / gather, bias) around their own `_matmul`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from app.models.parallel import SINGLE, TPContext


class QuantizedLinear(nn.Module):
    """y = x W^T + b for any leading shape of x, W held quantized by the subclass."""

    in_features: int
    out_features: int
    tp: TPContext
    reduce_output: bool  # row parallel: sum the ranks' partial outputs
    gather_output: bool  # column parallel with a gathered output
    bias: nn.Parameter | None

    @staticmethod
    def role_of(layer: nn.Module) -> dict[str, Any]:
        """The keyword arguments that give a replacement `layer`'s bias, parameter dtype,
        weight loader and tensor-parallel role."""
        from app.models.layers import RowParallelLinear

        return {
            "bias": layer.bias is not None,
            "params_dtype": getattr(layer, "params_dtype", layer.weight.dtype),
            "weight_loader": getattr(layer, "weight_loader", None),
            "tp": getattr(layer, "tp", SINGLE),
            "reduce_output": isinstance(layer, RowParallelLinear) and layer.reduce_results,
            "gather_output": getattr(layer, "gather_output", False),
        }

    def _columns(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K], the input columns in the order the stored weight expects."""
        return x.contiguous()

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] -> [M, N]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = self._columns(x.reshape(-1, self.in_features))
        y = self._matmul(x2) if x2.shape[0] else x2.new_empty(0, self.out_features)
        y = y.reshape(*lead, self.out_features)
        if self.reduce_output:
            y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return self.tp.all_gather_last(y) if self.gather_output else y
