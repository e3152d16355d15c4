"""Quantized checkpoints: read `quantization_config`, swap in `Int4Linear`s, convert tensors.

`prepare_quantized(model, quantization_config, path)` is the loader's one hook. It reads the
config, lists the checkpoint's tensor names and shapes (no data), replaces each linear whose
checkpoint tensors are INT4 with an empty `Int4Linear`, and returns a function that rewrites
the loader's `(name, tensor)` stream: a quantized module's parts are buffered until all have
arrived and then emitted in our layout (`qweight`, `scales`, `zeros`, `perm`) under the
checkpoint's module name, so `packed_modules_mapping` and the TP weight loaders apply as for
dense weights. FP8 checkpoints (block-scaled `weight_scale_inv`, compressed-tensors
float-quantized) swap in `Fp8Linear`s and stay FP8; 8-bit integer formats are dequantized to
dense `weight` tensors.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from app.quant import layouts
from app.quant.fp8 import Fp8Format
from app.quant.fp8_linear import Fp8Linear, block_for
from app.quant.int4 import Int4Weight
from app.quant.int4_linear import Int4Linear
from app.quant.schemes import Int4Scheme, QuantPlan, parse_quantization_config

log = logging.getLogger(__name__)
Stream = Iterable[tuple[str, torch.Tensor]]


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in the folder's safetensors files, without reading data."""
    from app.models.loader import safetensors_files

    shapes = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _our_module(model: nn.Module, prefix: str) -> str:
    """Checkpoint module name -> our (possibly merged) module name."""
    for fragment, (ours, _) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{fragment}." in prefix + ".":
            return (prefix + ".").replace(f".{fragment}.", f".{ours}.")[:-1]
    return prefix


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _swap_int4_modules(model: nn.Module, schemes: dict[str, Int4Scheme]) -> None:
    """schemes: checkpoint module prefix -> scheme. Shards of a merged module must agree."""
    merged: dict[str, Int4Scheme] = {}
    for prefix, scheme in schemes.items():
        ours = _our_module(model, prefix)
        if merged.setdefault(ours, scheme) != scheme:
            raise ValueError(f"shards of {ours} quantized differently: {merged[ours]} vs {scheme}")
    modules = dict(model.named_modules())
    for ours, s in merged.items():
        layer = modules.get(ours)
        if layer is None or not hasattr(layer, "in_features"):
            raise ValueError(f"quantized checkpoint tensors for {ours!r}, which is not a linear")
        _replace(model, ours, Int4Linear.like(layer, s.group_size, s.symmetric, s.act_order))
        layer.weight = None  # its weight_loader lives on in the Int4Linear; no dense copy
    log.info("INT4 checkpoint: %d linear modules are INT4", len(merged))


def _emit_int4(prefix: str, qw: Int4Weight, perm: torch.Tensor | None) -> list:
    out = [(f"{prefix}.qweight", qw.qweight), (f"{prefix}.scales", qw.scales)]
    if qw.zeros is not None:
        out.append((f"{prefix}.zeros", qw.zeros))
    if perm is not None:
        out.append((f"{prefix}.perm", perm))
    return out


class _Converter:
    """Buffers each quantized module's parts and emits our tensors once all have arrived."""

    def __init__(self, scheme_of: dict[str, Int4Scheme], parts_of: dict[str, set[str]], fmt):
        self.scheme_of, self.parts_of, self.fmt = scheme_of, parts_of, fmt
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    def __call__(self, stream: Stream) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in stream:
            prefix, _, suffix = name.rpartition(".")
            if prefix not in self.parts_of or suffix not in self.parts_of[prefix]:
                yield name, tensor
                continue
            parts = self.pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if set(parts) == self.parts_of[prefix]:
                del self.pending[prefix]
                yield from self.fmt.convert(prefix, parts, self.scheme_of.get(prefix))
        if self.pending:
            missing = {p: sorted(self.parts_of[p] - set(v)) for p, v in self.pending.items()}
            raise ValueError(f"incomplete quantized tensors: {dict(list(missing.items())[:4])}")


class Int4Format:
    """compressed-tensors pack-quantized, GPTQ or AWQ: INT4 kept as INT4."""

    def __init__(self, kind: str, parts: tuple[str, ...], marker: str, zeros_offset: int = 0):
        self.kind, self.parts, self.marker, self.zeros_offset = kind, parts, marker, zeros_offset

    def convert(self, prefix: str, parts: dict, scheme: Int4Scheme) -> list:
        g, sym = scheme.group_size, scheme.symmetric
        if self.kind == "compressed-tensors":
            qw, perm = layouts.from_compressed_tensors(parts, g, sym)
        elif self.kind == "gptq":
            qw, perm = layouts.from_gptq(parts, g, sym, self.zeros_offset)
        else:
            qw, perm = layouts.from_awq(parts, g)
        if perm is not None and not scheme.act_order:
            raise ValueError(f"{prefix}: g_idx permutes input columns but desc_act is off")
        if perm is None and scheme.act_order:  # act-order config, trivially ordered layer
            perm = torch.arange(qw.shape[1])
        return _emit_int4(prefix, qw, perm)


def _swap_fp8_modules(model: nn.Module, fmt: Fp8Format, shapes: dict, prefixes: list) -> None:
    """Every linear with FP8 checkpoint tensors becomes an `Fp8Linear` (weight kept FP8)."""
    merged: dict[str, tuple] = {}
    for p in prefixes:
        wshape = shapes[f"{p}.weight"]
        block = fmt.checkpoint_block(wshape, shapes[f"{p}.{fmt.scale_name}"])
        ours = _our_module(model, p)
        if merged.setdefault(ours, (block, wshape[1])) != (block, wshape[1]):
            raise ValueError(f"shards of {ours} have different FP8 scale blocks")
        fmt.blocks[p] = block
    modules = dict(model.named_modules())
    for ours, (block, k_full) in merged.items():
        layer = modules.get(ours)
        if layer is None or not hasattr(layer, "in_features"):
            raise ValueError(f"FP8 checkpoint tensors for {ours!r}, which is not a linear")
        _replace(model, ours, Fp8Linear.like(layer, block_for(layer, block, k_full)))
        layer.weight = None  # its weight_loader lives on in the Fp8Linear; no dense copy
    log.info("FP8 checkpoint: %d linear modules kept in FP8", len(merged))


class DenseFormat:
    """compressed-tensors naive-quantized (8-bit int): dequantized on load."""

    def __init__(self, kind: str, parts: tuple[str, ...], marker: str, block=None, dtype=None):
        self.kind, self.parts, self.marker, self.block = kind, parts, marker, block
        self.dtype = dtype or torch.bfloat16

    def convert(self, prefix: str, parts: dict, scheme) -> list:
        w = parts["weight"]
        s = layouts.expand_scale(parts["weight_scale"], tuple(w.shape))
        z = parts.get("weight_zero_point")
        z = layouts.expand_scale(z, tuple(w.shape)) if z is not None else 0.0
        dense = ((w.float() - z) * s).to(self.dtype)
        return [(f"{prefix}.weight", dense)]


def prepare_quantized(
    model: nn.Module | None, quantization_config: dict, path: str, dtype: torch.dtype | None = None
) -> Callable[[Stream], Iterator[tuple[str, torch.Tensor]]]:
    """Swap INT4 modules into `model` and return the checkpoint-stream converter.

    FP8 is kept FP8 in the given model; pass None to just convert a stream (FP8 and 8-bit
    are then dequantized to dense tensors)."""
    plan = parse_quantization_config(quantization_config)
    shapes = checkpoint_shapes(path)
    if model is not None:  # the names the loader streams: another EP rank's experts and
        # unbuilt MTP layers dropped, MTP layers renamed (model.layers.{L} -> mtp.layers.0)
        shapes = {
            model.checkpoint_name(n): s for n, s in shapes.items() if not model.skips_weight(n)
        }
    fmt = make_format(plan, dtype)
    names = set(shapes)
    prefixes = sorted({n.rpartition(".")[0] for n in names if n.endswith("." + fmt.marker)})
    if not prefixes:
        raise ValueError(
            f"quantization_config says {plan.describe()} but no tensor ends in .{fmt.marker}"
        )
    parts_of = {p: {s for s in fmt.parts if f"{p}.{s}" in names} for p in prefixes}
    scheme_of: dict[str, Int4Scheme] = {}
    if isinstance(fmt, Int4Format):
        if model is None:
            raise ValueError(f"checkpoint is already INT4 ({plan.describe()})")
        for p in prefixes:
            scheme = plan.scheme_for(p, shapes, fmt.marker)
            act_order = _has_act_order(parts_of[p], plan)
            scheme_of[p] = dataclasses.replace(scheme, act_order=act_order)
        _swap_int4_modules(model, scheme_of)
    elif isinstance(fmt, Fp8Format) and model is not None:
        _swap_fp8_modules(model, fmt, shapes, prefixes)
    return _Converter(scheme_of, parts_of, fmt)


def _has_act_order(parts: set[str], plan) -> bool:
    # GPTQ always stores g_idx; only desc_act makes it a real permutation.
    if "g_idx" in parts:
        return bool(plan.act_order)
    return "weight_g_idx" in parts


def make_format(plan: QuantPlan, dtype=None):
    """The checkpoint format a parsed quantization_config names (INT4, FP8 or dense)."""
    if plan.fmt == "pack-quantized":
        parts = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
        return Int4Format("compressed-tensors", (*parts, "weight_g_idx"), "weight_packed")
    if plan.fmt == "gptq":
        parts = ("qweight", "qzeros", "scales", "g_idx")
        return Int4Format("gptq", parts, "qweight", plan.zeros_offset)
    if plan.fmt == "awq":
        return Int4Format("awq", ("qweight", "qzeros", "scales"), "qweight")
    if plan.fmt == "fp8-block":
        return Fp8Format("weight_scale_inv", plan.block_size, dtype)
    if plan.fmt == "float-quantized":
        return Fp8Format("weight_scale", plan.block_size, dtype)
    parts = ("weight", "weight_scale", "weight_zero_point")
    return DenseFormat(plan.fmt, parts, "weight_scale", None, dtype)
