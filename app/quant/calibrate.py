"""GPTQ over a whole model: Hessians from calibration text, then per-layer GPTQ.

All Hessians come from one pass of the unquantized model (each layer sees full-precision
inputs), not layer by layer through already-quantized predecessors: simpler, one forward
pass, and slightly less accurate than sequential GPTQ.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from app.quant.apply import linear_modules
from app.quant.fp8_linear import Fp8Linear, output_shards
from app.quant.gptq import HessianAccumulator, quantize_gptq
from app.quant.int4 import Int4Weight

log = logging.getLogger(__name__)


def dense_causal_attention(layer: int, q, k, v) -> torch.Tensor:
    """One sequence, no cache: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    )
    return o.transpose(0, 1)


def calibration_sequences(ids: list[int], seq_len: int, max_seqs: int) -> list[torch.Tensor]:
    seqs = [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)][:max_seqs]
    seqs = [s for s in seqs if len(s) >= 2]
    if not seqs:
        raise ValueError("calibration text is empty after tokenization")
    return [torch.tensor(s, dtype=torch.long) for s in seqs]


@torch.no_grad()
def collect_hessians(
    model: nn.Module, seqs: list[torch.Tensor], skip=(), progress: bool = False
) -> dict[str, torch.Tensor]:
    """name -> H = 2/n X^T X of each linear layer's inputs over the calibration tokens."""
    layers = linear_modules(model, skip)
    device = next(model.parameters()).device
    accs = {n: HessianAccumulator(m.in_features, device) for n, m in layers.items()}
    hooks = [
        m.register_forward_hook(lambda mod, args, out, n=n: accs[n].add(args[0]))
        for n, m in layers.items()
    ]
    try:
        for ids in tqdm(seqs, desc="calibrating", disable=not progress):
            ids = ids.to(device)
            model(ids, torch.arange(len(ids), device=device), dense_causal_attention)
    finally:
        for h in hooks:
            h.remove()
    return {n: a.h for n, a in accs.items()}


def split_to_checkpoint_names(model: nn.Module, name: str, qw: Int4Weight):
    """Our (possibly merged) module -> [(checkpoint module name, Int4Weight rows)]."""
    prefix, _, leaf = name.rpartition(".")
    layer = model.get_submodule(name)
    parts = [
        (f"{prefix}.{frag}", shard)
        for frag, (ours, shard) in getattr(model, "packed_modules_mapping", {}).items()
        if ours == leaf
    ]
    if not parts:
        return [(name, qw)]
    shards = output_shards(layer)
    return [(ckpt, qw.rows(*shards[shard])) for ckpt, shard in parts]


def dense_weight(layer: nn.Module) -> torch.Tensor:
    """[N, K] float32: what GPTQ quantizes (an FP8 source layer's weight dequantized)."""
    if isinstance(layer, Fp8Linear):
        return layer.dequantized_weight(torch.float32)
    return layer.weight.data


def gptq_model(
    model: nn.Module,
    seqs: list[torch.Tensor],
    group_size: int,
    symmetric: bool,
    act_order: bool = False,
    skip=(),
    scale_dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
) -> dict[str, Int4Weight]:
    """checkpoint module name -> GPTQ Int4Weight for every linear whose K fits the group."""
    hessians = collect_hessians(model, seqs, skip, progress)
    out: dict[str, Int4Weight] = {}
    layers = linear_modules(model, skip)
    for name, layer in tqdm(layers.items(), desc="GPTQ", disable=not progress):
        if layer.in_features % group_size:
            log.warning(
                "%s: in_features=%d not a multiple of %d; left dense",
                name,
                layer.in_features,
                group_size,
            )
            continue
        qw = quantize_gptq(
            dense_weight(layer),
            hessians.pop(name),
            group_size,
            symmetric,
            act_order,
            scale_dtype=scale_dtype,
        )
        out.update(split_to_checkpoint_names(model, name, qw))
    return out
