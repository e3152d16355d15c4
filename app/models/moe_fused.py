"""Stack a MoE layer's expert modules into one `slimserve_kernels.moe_common.MoEWeights` for
the fused kernels, without a second copy: every expert's parameters become views into the stacks.

Experts stay `GatedMLP` modules (checkpoint names, table-driven loading, TP/EP loaders,
module replacement by app.quant). The first fused forward after loading stacks them; the
weights are found by duck typing (app.models does not import app.quant):

- dense linears (`weight`)                      -> kind "dense"
- FP8 linears (`weight` e4m3, `weight_scale_inv`, `block`) -> kind "fp8"
- INT4 linears (`qweight`, `scales`, `zeros`, `group_size`, no act-order `perm`) -> "int4"

Anything else (mixed kinds, act-order INT4, unequal FP8 blocks or INT4 groups across
experts, a group the kernel lacks) returns None and the layer keeps the per-expert loop.
"""

from __future__ import annotations

import torch
from torch import nn

from slimserve_kernels.moe_common import MoEWeights

INT4_KERNEL_GROUPS = (32, 64, 128)


def _kind(layer: nn.Module) -> str | None:
    if hasattr(layer, "qweight"):
        return "int4" if getattr(layer, "perm", None) is None else None
    if hasattr(layer, "weight_scale_inv"):
        return "fp8"
    if isinstance(getattr(layer, "weight", None), torch.Tensor) and layer.bias is None:
        return "dense"
    return None


def _stack(layers: list[nn.Module], name: str) -> torch.Tensor | None:
    """Stack `name` of every layer into [E, ...] and re-point each layer's parameter to its
    slice, so the per-expert tensors are freed and loaders keep writing into the stack."""
    params = [getattr(layer, name) for layer in layers]
    if params[0] is None:
        return None
    stacked = torch.stack([p.data for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


def _uniform(layers: list[nn.Module], attr: str):
    values = {getattr(layer, attr) for layer in layers}
    return values.pop() if len(values) == 1 else None


def stack_experts(experts: list[nn.Module]) -> MoEWeights | None:
    """experts: this rank's `GatedMLP`s (gate_up_proj, down_proj) -> MoEWeights or None."""
    ups = [e.gate_up_proj for e in experts]
    downs = [e.down_proj for e in experts]
    kinds = {_kind(m) for m in ups + downs}
    if len(kinds) != 1 or None in kinds:
        return None
    kind = kinds.pop()
    if kind == "dense":
        return MoEWeights("dense", _stack(ups, "weight"), _stack(downs, "weight"))
    if kind == "fp8":
        b13, b2 = _uniform(ups, "block"), _uniform(downs, "block")
        if b13 is None or b2 is None:
            return None
        w13, s13 = _stack(ups, "weight"), _stack(ups, "weight_scale_inv")
        w2, s2 = _stack(downs, "weight"), _stack(downs, "weight_scale_inv")
        return MoEWeights("fp8", w13, w2, s13, s2, block=b13, block2=b2)
    group = _uniform(ups + downs, "group_size")
    sym = {m.zeros is None for m in ups + downs}
    if group not in INT4_KERNEL_GROUPS or len(sym) != 1:
        return None
    w13, s13, z13 = (_stack(ups, n) for n in ("qweight", "scales", "zeros"))
    w2, s2, z2 = (_stack(downs, n) for n in ("qweight", "scales", "zeros"))
    return MoEWeights("int4", w13, w2, s13, s2, z13, z2, group=group)
