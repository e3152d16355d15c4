"""`Fp8Linear`: FP8 drop-in for the model's linear layers (W8A16 or W8A8 by `fp8_activations`);
the weight stays FP8 in memory.

`weight [N, K] float8_e4m3fn` and `weight_scale_inv [ceil(N/bn), ceil(K/bk)] float32`
(`W = weight * scale`, per block; DeepSeek-V3's name, although it multiplies). Blocks:
128 x 128 (DeepSeek-V3 / Kimi K2 / GLM-4.5-FP8 checkpoints, `weight_quant="fp8"`), 1 x K
(per output channel), or 1 x bk when a checkpoint's block rows do not line up with this
layer's merged shards or tensor-parallel slices (e.g. q/k/v of a model with 64-row k_proj).

CUDA: `slimserve_kernels.fp8_gemm` (Triton W8A16, dequantized in the kernel) or, by the
`fp8_activations` rule (fp8_activations.py), W8A8: the activations quantized per token group
to FP8 and `slimserve_kernels.triton_fp8_w8a8_gemm`. CPU: the weight is dequantized to the
activation dtype for each forward (one layer at a time, then freed), so resident memory stays
FP8 on both.

Loading: the format converter (formats.py) hands the scale over expanded to one row per
output row (`[N_ckpt, K_blocks]`), so the layer's own weight loader (merged, QKV, column or
row parallel) slices it exactly as it slices the weight; the rows it wrote are then folded
back into this layer's blocks, checking that every block received one value.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import slimserve_kernels
from app.models.parallel import SINGLE
from app.quant.fp8_activations import use_w8a8
from app.quant.linear import UNSHARDED, LinearRole, QuantizedLinear
from app.quant.params import copy_loader, loaded_param
from slimserve_kernels.fp8_cpu import dequantize_fp8_cpu

FP8_DTYPE = torch.float8_e4m3fn


class Fp8Linear(QuantizedLinear):
    """y = x W^T + b with W = FP8 weight x block scales; TP semantics of the layer it replaces."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        block: tuple[int, int],
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        weight_loader=None,
        role: LinearRole = UNSHARDED,
    ):
        super().__init__(in_features, out_features, role)
        n, k = out_features, in_features
        self.block = (int(block[0]), int(block[1]))
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self._loader = weight_loader or copy_loader
        self.weight_loader = self._loader  # what a later module replacement (INT4) inherits
        scale_shape = (math.ceil(n / self.block[0]), math.ceil(k / self.block[1]))
        self.weight = loaded_param(torch.zeros(n, k, dtype=FP8_DTYPE), self._loader)
        self.weight_scale_inv = loaded_param(torch.ones(scale_shape), self._load_scale_rows)
        self.bias = (
            loaded_param(torch.zeros(n, dtype=self.params_dtype), self._loader) if bias else None
        )
        self.shards: dict = {}  # the replaced layer's `output_shards` (merged projections)
        self.fp8_activations = "auto"  # the engine option (set_fp8_activations)

    @classmethod
    def like(cls, layer: nn.Module, block: tuple[int, int]) -> Fp8Linear:
        """An empty Fp8Linear with `layer`'s shape, bias, TP role and weight loader."""
        with torch.device(layer.weight.device):
            new = cls(layer.in_features, layer.out_features, block, **cls.replacing(layer))
        new.shards = output_shards(layer)
        return new

    def _load_scale_rows(self, param, rows: torch.Tensor, shard_id=None) -> None:
        """rows: [N_ckpt, K_blocks] float32, one scale row per checkpoint output row."""
        rows = rows.float()
        if self.row_parallel and self.tp.size > 1 and rows.shape[1] == 1:
            rows = rows.expand(-1, self.tp.size)  # per-channel: every K slice shares it
        buf = torch.full((self.out_features, param.shape[1]), float("nan"), device=param.device)
        self._loader(buf, rows, shard_id)  # the layer's own slicing (merged, QKV, TP)
        idx = (~buf[:, 0].isnan()).nonzero().squeeze(1)
        blocks = idx // self.block[0]
        param.data[blocks] = buf[idx]
        if not torch.equal(param.data[blocks], buf[idx]):
            raise ValueError(
                f"FP8 scales: rows {int(idx[0])}..{int(idx[-1])} of a {self.out_features}-row "
                f"layer do not share scale blocks of {self.block[0]} rows"
            )

    def set_weight(self, weight: torch.Tensor, scale: torch.Tensor, bias=None) -> None:
        assert weight.shape == self.weight.shape and scale.shape == self.weight_scale_inv.shape
        self.weight.data.copy_(weight)
        self.weight_scale_inv.data.copy_(scale)
        if bias is not None:
            self.bias.data.copy_(bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in dtype (on CPU through the FP8 table: slimserve_kernels/fp8_cpu.py)."""
        return dequantize_fp8_cpu(self.weight, self.weight_scale_inv, self.block, dtype)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] -> [M, N]
        if not slimserve_kernels.use_triton(x):  # CPU: W8A16 through a per-layer dequant
            return F.linear(x, self.dequantized_weight(x.dtype))
        args = (x, self.weight, self.weight_scale_inv, self.block)
        if use_w8a8(self.fp8_activations, x, self.weight.shape[0]):
            return slimserve_kernels.triton_fp8_w8a8_gemm(*args)
        return slimserve_kernels.triton_fp8_gemm(*args)

    def extra_repr(self) -> str:
        acts = self.fp8_activations
        return (
            f"in={self.in_features}, out={self.out_features}, fp8 e4m3, block={self.block}, {acts}"
        )


def set_fp8_activations(model: nn.Module, mode: str) -> int:
    """Every `Fp8Linear` of the model runs W8A8 / W8A16 by `mode` (fp8_activations.py);
    returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.fp8_activations = mode
    return len(layers)


def output_shards(layer: nn.Module) -> dict:
    """Loader shard id ("q"/"k"/"v", or 0..n-1) -> (local row offset, rows) of each checkpoint
    projection merged into `layer`; {} for a plain linear. An `Fp8Linear` answers for the
    merged layer it replaced (GPTQ splits its rows back into checkpoint names)."""
    from app.models.layers import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(layer, Fp8Linear):
        return layer.shards
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.n_heads * layer.head_dim, layer.n_kv * layer.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = layer.out_sizes
        return {i: (sum(sizes[:i]), s) for i, s in enumerate(sizes)}
    return {}


def shard_rows(layer: nn.Module) -> list[tuple[int, int, int]]:
    """(local row offset, rows, first checkpoint row) of each shard the layer's loader writes."""
    from app.models.layers import MergedColumnParallelLinear, QKVParallelLinear

    tp, n = getattr(layer, "tp", SINGLE), layer.out_features
    if isinstance(layer, QKVParallelLinear):
        d = layer.head_dim
        q, kv = layer.n_heads * d, layer.n_kv * d
        start = layer.kv_start * d
        return [(0, q, tp.rank * q), (q, kv, start), (q + kv, kv, start)]
    if isinstance(layer, MergedColumnParallelLinear):
        offs = [sum(layer.out_sizes[:i]) for i in range(len(layer.out_sizes))]
        return [(o, s, tp.rank * s) for o, s in zip(offs, layer.out_sizes)]
    if hasattr(layer, "gather_output"):  # column parallel
        return [(0, n, tp.rank * n)]
    return [(0, n, 0)]


def block_for(layer: nn.Module, ckpt_block: tuple[int, int], k_full: int) -> tuple[int, int]:
    """This layer's scale block for a checkpoint's (bn, bk): bn if every shard starts and
    ends on a block row (local and in the checkpoint), else 1 (one scale row per row)."""
    bn, bk = ckpt_block
    if bk >= k_full:  # per channel (or per tensor): one scale column
        bk = layer.in_features
    elif layer.in_features % bk and layer.in_features != k_full:
        raise ValueError(
            f"FP8 scale blocks of {bk} input columns straddle the tensor-parallel slices of "
            f"{layer.in_features} columns; use a tensor_parallel_size whose slices are multiples"
        )
    shards = shard_rows(layer)
    aligned = all(o % bn == 0 and start % bn == 0 for o, _, start in shards) and all(
        s % bn == 0 for o, s, _ in shards if o + s < layer.out_features
    )
    return (bn if aligned else 1, bk)
