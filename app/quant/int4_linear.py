"""`Int4Linear`: W4A16 drop-in for the model's linear layers (module replacement).

On CUDA it calls `slimserve_kernels.int4_gemm_kn` (Triton GEMV / split-K GEMM; groups 32/64/128,
larger multiples are split into those) on the K-major layout (`slimserve_kernels.int4_layout`),
made when the layer first runs on CUDA: the checkpoint's layout is unchanged, and qweight and
scales are re-stored column-major in place so the K-major tensors are views of them (one copy
of the words in GPU memory). On CPU it calls PyTorch's built-in int4
matmul, `aten._weight_int4pack_mm_for_cpu`, on a weight converted once by
`aten._convert_weight_to_int4pack_for_cpu`. Their conventions, found by experiment on
torch 2.13 (tests/quant/test_int4_linear.py pins them):

- `_convert_weight_to_int4pack_for_cpu(codes [N, K] int32 in 0..15, inner_k_tiles)`
  -> `[N, K/2] uint8` (inner_k_tiles is ignored on CPU); N must be a multiple of 16.
- `_weight_int4pack_mm_for_cpu(x [M, K], packed, group, scale_zeros [K/group, N, 2])`
  computes `W[n, k] = (q - 8) * scale + zero`: the zero is a float *offset*, not an integer
  zero point; group must be 32, 64, 128 or 256; scale_zeros has x's dtype.

Our `(q - z) * s` is `(q - 8) * s + (8 - z) * s`, so the offset is `(8 - z) * s` (0 when
symmetric). Rows are zero-padded to a multiple of 16; a group of 512 or more is split into
supported ones by repeating its scale. Any other group size (e.g. 16) has no CPU kernel: the
weight is dequantized once and cached.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import slimserve_kernels
from app.quant.int4 import SYM_ZERO, Int4Weight
from app.quant.linear import UNSHARDED, LinearRole, QuantizedLinear
from app.quant.params import copy_loader, loaded_param
from slimserve_kernels.int4_layout import Int4KN, column_major

log = logging.getLogger(__name__)
CPU_GROUPS = (256, 128, 64, 32)
GPU_GROUPS = (128, 64, 32)  # what slimserve_kernels.int4_gemm (Triton) accepts
CPU_ROW_MULTIPLE = 16


def regroup(qw: Int4Weight, supported: tuple[int, ...]) -> Int4Weight:
    """The same weight with a group size a kernel supports: a group of g splits into g/g'
    groups of one of `supported` (largest first) sharing its scale and zero. Exact."""
    if qw.group_size in supported:
        return qw
    g = next((c for c in supported if qw.group_size % c == 0), None)
    if g is None:
        raise ValueError(f"group_size {qw.group_size} is not a multiple of any of {supported}")
    rep = qw.group_size // g
    zeros = None if qw.zeros is None else qw.zeros.repeat_interleave(rep, 1)
    return Int4Weight(qw.qweight, qw.scales.repeat_interleave(rep, 1), zeros, g)


@dataclass(slots=True)
class CpuInt4Pack:
    """The weight as `_weight_int4pack_mm_for_cpu` wants it, built once per dtype."""

    packed: torch.Tensor | None  # [Np, K/2] uint8, Np = N rounded up to 16
    scale_zeros: torch.Tensor | None  # [K/group, Np, 2] in the activation dtype
    group: int
    dense: torch.Tensor | None = None  # [N, K]: only for group sizes without a CPU kernel

    @classmethod
    def build(cls, qw: Int4Weight, dtype: torch.dtype) -> CpuInt4Pack:
        g = next((c for c in CPU_GROUPS if qw.group_size % c == 0), None)
        if g is None:
            log.warning("group_size %d has no CPU int4 kernel; caching dense", qw.group_size)
            return cls(None, None, qw.group_size, qw.dequantize(dtype))
        qw = regroup(qw, CPU_GROUPS)
        n, _ = qw.shape
        pad = -n % CPU_ROW_MULTIPLE
        codes = F.pad(qw.codes().to(torch.int32), (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        s, z = qw.scales.float(), qw.zeros_or_default().float()
        offset = (SYM_ZERO - z) * s
        sz = torch.stack([s, offset], dim=-1)  # [N, K/g, 2]
        sz = F.pad(sz, (0, 0, 0, 0, 0, pad)).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, sz, qw.group_size)

    def matmul(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x: [M, K] -> [M, N]."""
        if self.dense is not None:
            return x @ self.dense.T
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zeros)
        return y[:, :n]


class Int4Linear(QuantizedLinear):
    """y = x W^T + b with W in INT4 (canonical layout); TP semantics of the layer it replaces.

    `perm` (act-order checkpoints) permutes the input columns so that groups are contiguous:
    y = x[:, perm] @ W_sorted^T.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        symmetric: bool,
        bias: bool = False,
        act_order: bool = False,
        params_dtype: torch.dtype | None = None,
        weight_loader=None,
        role: LinearRole = UNSHARDED,
    ):
        super().__init__(in_features, out_features, role)
        tp = role.tp
        if in_features % group_size or group_size % 8:
            shard = f" per rank (tensor_parallel_size={tp.size})" if tp.size > 1 else ""
            raise ValueError(
                f"in_features={in_features}{shard} incompatible with INT4 group {group_size}: "
                "a group may not straddle ranks, so the group must divide each rank's shard"
            )
        if act_order and role.reduce_output and tp.size > 1:
            raise NotImplementedError("act-order INT4 with row-parallel tensor parallelism")
        dtype = params_dtype or torch.get_default_dtype()
        loader = self._invalidating(weight_loader or copy_loader)
        n, k, g = out_features, in_features, group_size
        self.group_size = g
        self.qweight = loaded_param(torch.zeros(n, k // 8, dtype=torch.int32), loader)
        self.scales = loaded_param(torch.ones(n, k // g, dtype=dtype), loader)
        zeros = None if symmetric else torch.full((n, k // g), SYM_ZERO, dtype=torch.uint8)
        self.zeros = None if zeros is None else loaded_param(zeros, loader)
        self.bias = loaded_param(torch.zeros(n, dtype=dtype), loader) if bias else None
        perm_loader = self._invalidating(self._load_perm)
        self.perm = loaded_param(torch.arange(k), perm_loader) if act_order else None
        self._perm_loaded = False
        self._cpu: dict[torch.dtype, CpuInt4Pack] = {}
        self._gpu: dict[str, Int4KN] = {}

    def _invalidating(self, loader):
        def load(param, loaded, shard_id=None):
            self._cpu, self._gpu = {}, {}
            loader(param, loaded, shard_id)

        return load

    def _load_perm(self, param, loaded, shard_id=None) -> None:
        # Shards of a merged layer (q/k/v, gate/up) read one input, so one permutation.
        if self._perm_loaded and not torch.equal(param.data, loaded.to(param.device)):
            raise ValueError("shards of a merged INT4 layer have different act-order g_idx")
        copy_loader(param, loaded)
        self._perm_loaded = True

    @classmethod
    def like(
        cls, layer: nn.Module, group_size: int, symmetric: bool, act_order: bool = False
    ) -> Int4Linear:
        """An empty Int4Linear with `layer`'s shape, bias, TP role and weight loader."""
        with torch.device(layer.weight.device):
            return cls(
                layer.in_features,
                layer.out_features,
                group_size,
                symmetric,
                act_order=act_order,
                **cls.replacing(layer),
            )

    @property
    def params_dtype(self) -> torch.dtype:
        return self.scales.dtype

    @property
    def weight_int4(self) -> Int4Weight:
        zeros = None if self.zeros is None else self.zeros.data
        return Int4Weight(self.qweight.data, self.scales.data, zeros, self.group_size)

    def set_weight(self, qw: Int4Weight, bias: torch.Tensor | None = None) -> None:
        assert qw.shape == (self.out_features, self.in_features), "shape mismatch"
        assert qw.group_size == self.group_size and (qw.zeros is None) == (self.zeros is None)
        self.qweight.data.copy_(qw.qweight)
        self.scales.data.copy_(qw.scales)
        if qw.zeros is not None:
            self.zeros.data.copy_(qw.zeros)
        if bias is not None:
            self.bias.data.copy_(bias)
        self._cpu, self._gpu = {}, {}

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in the original input-column order (undoing `perm`)."""
        w = self.weight_int4.dequantize(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def kernel_weight(self) -> Int4KN:
        """The weight as the CUDA kernels read it, made once (again after new weights load)."""
        w = self._gpu.get("kn")
        if w is None:
            if self.group_size in GPU_GROUPS:  # no regrouping: views of the parameters
                self.qweight.data = column_major(self.qweight.data)
                self.scales.data = column_major(self.scales.data)
            qw = regroup(self.weight_int4, GPU_GROUPS)
            w = self._gpu["kn"] = Int4KN.of(qw.qweight, qw.scales, qw.zeros, qw.group_size)
        return w

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [M, K] -> [M, N]
        if x.is_cuda:
            return slimserve_kernels.int4_gemm_kn(x.contiguous(), self.kernel_weight())
        pack = self._cpu.get(x.dtype)
        if pack is None:
            pack = self._cpu[x.dtype] = CpuInt4Pack.build(self.weight_int4, x.dtype)
        return pack.matmul(x.contiguous(), self.out_features)

    def _columns(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.perm is None else x.index_select(1, self.perm)

    def extra_repr(self) -> str:
        sym = "symmetric" if self.zeros is None else "asymmetric"
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}, {sym}"
