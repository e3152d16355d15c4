"""Module replacement: swap a loaded model's linear layers for `Int4Linear`s or `Fp8Linear`s.

Only linear layers are candidates (our `LinearBase` family and `nn.Linear`); the LM head,
embeddings and norms are other module types and stay in their dtype. `skip` adds patterns
(see `matches_any`) to keep more layers unquantized.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from app.quant.fp8 import quantize_fp8_block
from app.quant.fp8_linear import Fp8Linear
from app.quant.gptq import quantize_gptq
from app.quant.int4 import GROUP_SIZES, quantize_rtn
from app.quant.int4_linear import Int4Linear

log = logging.getLogger(__name__)
DEFAULT_GROUP_SIZE = 128
FP8_BLOCK = (128, 128)


def is_linear(module: nn.Module) -> bool:
    from app.models.layers import LinearBase

    return isinstance(module, (LinearBase, nn.Linear, Fp8Linear))


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """`re:<regex>` matches from the start of the name; a plain pattern matches the whole
    name or its last dotted components (`down_proj` matches `model.layers.0.mlp.down_proj`)."""
    for p in patterns:
        if p.startswith("re:") and re.match(p[3:], name):
            return True
        if not p.startswith("re:") and (name == p or name.endswith("." + p)):
            return True
    return False


def _group_for(in_features: int, group_size: int, fallback: bool) -> int | None:
    if in_features % group_size == 0:
        return group_size
    if fallback:  # the largest standard group below the requested one that fits
        return next(
            (
                g
                for g in sorted(GROUP_SIZES, reverse=True)
                if g < group_size and in_features % g == 0
            ),
            None,
        )
    return None


def linear_modules(model: nn.Module, skip: Iterable[str] = ()) -> dict[str, nn.Module]:
    """name -> linear module that quantization would replace (before group checks)."""
    skip = tuple(skip)
    return {
        n: m for n, m in model.named_modules() if n and is_linear(m) and not matches_any(n, skip)
    }


def _row_shards(layer: nn.Module) -> int:
    """How many ranks split this layer's input features (row-parallel), else 1."""
    from app.models.layers import RowParallelLinear

    row = isinstance(layer, RowParallelLinear) or getattr(layer, "row_parallel", False)
    return layer.tp.size if row else 1


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    group_size: int = DEFAULT_GROUP_SIZE,
    symmetric: bool = True,
    skip: Iterable[str] = (),
    hessians: dict[str, torch.Tensor] | None = None,
    act_order: bool = False,
    fallback_group: bool = False,
    progress: bool = False,
) -> dict[str, int]:
    """Replace linears in place (RTN, or GPTQ for names in `hessians`).

    Returns name -> group size used. A layer whose in_features no group divides is left
    dense (logged); with `fallback_group` a smaller standard group is tried first.
    """
    from tqdm import tqdm

    done: dict[str, int] = {}
    layers = linear_modules(model, skip)
    for name, layer in tqdm(layers.items(), desc="quantizing", disable=not progress):
        # Groups are chosen on the full (unsharded) input so every TP size quantizes alike.
        full_in = layer.in_features * _row_shards(layer)
        g = _group_for(full_in, group_size, fallback_group)
        if g is None:
            log.warning("%s: in_features=%d fits no group; left dense", name, full_in)
            continue
        w = _dense_weight(layer)
        if hessians is not None and name in hessians:
            h = hessians[name].to(w.device)
            qw = quantize_gptq(w, h, g, symmetric, act_order, scale_dtype=w.dtype)
        else:
            qw = quantize_rtn(w, g, symmetric, scale_dtype=w.dtype)
        with torch.device(w.device):
            new = Int4Linear.like(layer, g, symmetric)
        bias = layer.bias.data if layer.bias is not None else None
        new.set_weight(qw, bias)
        _replace(model, name, new)
        layer.weight = None  # its weight_loader lives on in `new`; the dense copy need not
        done[name] = g
    return done


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    """[N, K] in the layer's dtype (an FP8 checkpoint's Fp8Linear is dequantized)."""
    if isinstance(layer, Fp8Linear):
        return layer.dequantized_weight(layer.params_dtype)
    return layer.weight.data


@torch.no_grad()
def quantize_model_fp8(
    model: nn.Module, block: tuple[int, int] = FP8_BLOCK, skip: Iterable[str] = ()
) -> int:
    """Replace every dense linear with an `Fp8Linear` (e4m3, one fp32 scale per block of the
    rank-local weight). Returns how many were replaced."""
    done = 0
    for name, layer in linear_modules(model, skip).items():
        if isinstance(layer, Fp8Linear):
            continue
        q, scale = quantize_fp8_block(layer.weight.data, block)
        new = Fp8Linear.like(layer, block)
        new.set_weight(q, scale, layer.bias.data if layer.bias is not None else None)
        _replace(model, name, new)
        layer.weight = None  # the dense copy is freed; only FP8 stays resident
        done += 1
    return done


def apply_weight_quant(model: nn.Module, model_config, weight_quant: str | None) -> None:
    """The engine's hook for `weight_quant`: "int4" quantizes a non-INT4 checkpoint (RTN,
    symmetric, group 128, falling back to 64/32 where 128 does not divide in_features);
    "fp8" quantizes dense linears to FP8 e4m3 with 128 x 128 block scales."""
    from app.quant.schemes import is_int4

    if weight_quant is None:
        return
    if weight_quant not in ("int4", "fp8"):
        raise ValueError(f"weight_quant must be None, 'int4' or 'fp8', got {weight_quant!r}")
    if weight_quant == "fp8":
        if is_int4(getattr(model_config, "quantization_config", None)):
            raise ValueError("weight_quant='fp8' on an INT4 checkpoint: it would not be smaller")
        log.info("weight_quant=fp8: %d linear layers quantized", quantize_model_fp8(model))
        return
    if is_int4(getattr(model_config, "quantization_config", None)):
        log.info("checkpoint is already INT4; weight_quant=int4 keeps it as loaded")
        return
    done = quantize_model(model, DEFAULT_GROUP_SIZE, symmetric=True, fallback_group=True)
    log.info("weight_quant=int4: %d linear layers quantized (RTN)", len(done))
