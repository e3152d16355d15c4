"""`QuantizedLinear`: what `Fp8Linear` and `Int4Linear` share, the role of the layer they
replace (tensor-parallel reduce / gather, bias) around their own `_matmul`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from app.models.parallel import SINGLE, TPContext


@dataclass(frozen=True, slots=True)
class LinearRole:
    """The tensor-parallel role of the layer a quantized linear replaces."""

    tp: TPContext = SINGLE
    row_parallel: bool = False  # input columns split across ranks
    reduce_output: bool = False  # row parallel: sum the ranks' partial outputs
    gather_output: bool = False  # column parallel with a gathered output

    @classmethod
    def of(cls, layer: nn.Module) -> LinearRole:
        from app.models.layers import RowParallelLinear

        if isinstance(layer, QuantizedLinear):  # replaced again (an FP8 checkpoint -> INT4)
            return layer.role
        row = isinstance(layer, RowParallelLinear)
        return cls(
            tp=getattr(layer, "tp", SINGLE),
            row_parallel=row,
            reduce_output=row and layer.reduce_results,
            gather_output=getattr(layer, "gather_output", False),
        )


UNSHARDED = LinearRole()  # a layer on one rank


class QuantizedLinear(nn.Module):
    """y = x W^T + b for any leading shape of x, W held quantized by the subclass."""

    bias: nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, role: LinearRole):
        super().__init__()
        self.in_features, self.out_features, self.role = in_features, out_features, role
        # The role's fields under the names the linear layers use (TP code reads them).
        self.tp, self.row_parallel = role.tp, role.row_parallel
        self.reduce_output, self.gather_output = role.reduce_output, role.gather_output

    @staticmethod
    def replacing(layer: nn.Module) -> dict[str, Any]:
        """The keyword arguments that give a replacement `layer`'s bias, parameter dtype,
        weight loader and tensor-parallel role."""
        return {
            "bias": layer.bias is not None,
            "params_dtype": getattr(layer, "params_dtype", layer.weight.dtype),
            "weight_loader": getattr(layer, "weight_loader", None),
            "role": LinearRole.of(layer),
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
