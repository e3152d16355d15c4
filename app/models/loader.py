"""Builds a model from a Hugging Face checkpoint folder (safetensors, memory-mapped)."""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from app.config import ModelConfig
from app.models.hooks import CausalLM
from app.models.parallel import SINGLE, TPContext
from app.models.parallel_load import LazyTensor, materialize
from app.models.registry import model_class

log = logging.getLogger(__name__)
PrepareQuantized = Callable[[nn.Module, dict, str, torch.dtype], Callable]
# Buffers some checkpoints carry that our modules recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    return files


def iter_checkpoint(path: str, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of every shard, memory-mapped."""
    for file in tqdm(safetensors_files(path), desc="loading shards", disable=not progress):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, f.get_tensor(name)


def iter_checkpoint_lazy(path: str, progress: bool = False) -> Iterator[tuple[str, LazyTensor]]:
    """Like iter_checkpoint, but nothing is read until a weight loader copies its slice."""
    for file in tqdm(safetensors_files(path), desc="loading shards", disable=not progress):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                part = f.get_slice(name)
                yield name, LazyTensor(part, tuple(part.get_shape()))


def _read_where(stream, wanted) -> Iterator[tuple[str, torch.Tensor]]:
    """Reads in full the lazy tensors `wanted(name)` picks (e.g. packed INT4 parts)."""
    for name, t in stream:
        yield name, (materialize(t) if wanted(name) else t)


def _route(model: CausalLM, name: str) -> tuple[str, object]:
    """Checkpoint name -> (our parameter name, shard id) via packed_modules_mapping."""
    for fragment, (ours, shard) in model.packed_modules_mapping.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{ours}."), shard
    return name, None


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """weights: tensors or LazyTensors (each weight_loader reads only its rank's slice)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        # skips_weight: e.g. experts owned by another EP rank
        if name.endswith(IGNORED_SUFFIXES) or model.skips_weight(name):
            continue
        target, shard = _route(model, name)
        if target not in params:
            if target == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            log.warning("ignoring checkpoint tensor %s (no matching parameter)", name)
            continue
        param = params[target]
        param.weight_loader(param, tensor.to(param.dtype), shard)
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}")


def build_model(
    cfg: ModelConfig, dtype: torch.dtype, device, tp: TPContext = SINGLE, mtp: bool = False
) -> nn.Module:
    """mtp: also build the checkpoint's multi-token-prediction layers (app/models/mtp.py)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(cfg.architecture)(cfg, tp)
            if mtp:
                model.add_mtp_layers(tp)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def load_model(
    path: str,
    dtype: torch.dtype,
    device,
    tp: TPContext = SINGLE,
    progress: bool = False,
    mtp: bool = False,
    prepare_quantized: PrepareQuantized | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """prepare_quantized(model, quantization_config, path, dtype) -> a converter of the
    weight stream, for quantized checkpoints (app.quant.formats.prepare_quantized: passed
    in from above, since quantization sits above the models in the layers)."""
    cfg = ModelConfig.from_path(path)
    model = build_model(cfg, dtype, device, tp, mtp)
    weights = iter_checkpoint_lazy(path, progress)
    # Another rank's experts are never read; MTP layers: model.layers.{L + i} -> mtp.layers.{i}
    weights = ((model.checkpoint_name(n), t) for n, t in weights if not model.skips_weight(n))
    if cfg.quantization_config:  # INT4 / FP8 checkpoints: app.quant swaps modules, converts
        if prepare_quantized is None:
            raise ValueError(f"{path} is a quantized checkpoint; pass prepare_quantized")
        convert = prepare_quantized(model, cfg.quantization_config, path, dtype)
        # Converted modules (packed INT4, FP8) are read whole, one module at a time, then
        # narrowed by the weight loaders; every other tensor stays a lazy slice.
        parts = getattr(convert, "parts_of", {})
        weights = convert(_read_where(weights, lambda n: n.rpartition(".")[0] in parts))
    load_weights(model, weights)
    return model, cfg
