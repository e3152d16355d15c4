"""Write an INT4 checkpoint in compressed-tensors `pack-quantized` format (vLLM loads it).

The source is streamed tensor by tensor (BF16/FP16/FP32, or FP8 block-scaled, which is
dequantized first); each linear weight is replaced by `weight_packed`, `weight_scale`,
`weight_shape` (and `weight_zero_point` when asymmetric); everything else is copied.
Shards are written as they fill, so memory holds one shard, not the model.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

from app.quant.int4 import Int4Weight
from app.quant.layouts import to_compressed_tensors

# Modules that stay dense by default: the LM head and MoE routers (`mlp.gate`).
DEFAULT_SKIP = ("lm_head", r"re:.*\.mlp\.gate$")
SHARD_BYTES = 4 << 30
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def is_linear_weight(name: str, tensor_dim: int) -> bool:
    """A 2-D `.weight` that is not an embedding or norm table: a linear layer's weight."""
    if not name.endswith(".weight") or tensor_dim != 2:
        return False
    leaf = name[: -len(".weight")].rpartition(".")[2]
    return "embed" not in leaf and "norm" not in leaf and leaf != "wte"


def compressed_tensors_config(group_size: int, symmetric: bool, ignore: list[str]) -> dict:
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
    }
    group = {
        "targets": ["Linear"],
        "weights": weights,
        "input_activations": None,
        "output_activations": None,
        "format": "pack-quantized",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


class ShardWriter:
    """Collects tensors into safetensors shards of at most `shard_bytes`; writes the index."""

    def __init__(self, out: str, shard_bytes: int = SHARD_BYTES):
        self.out, self.shard_bytes = out, shard_bytes
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.tensor_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.shard_bytes:
            self._flush()
        self.current[name] = tensor.detach().cpu().contiguous()
        self.current_bytes += nbytes
        self.tensor_bytes += nbytes

    def _flush(self) -> None:
        name = f"shard-{len(self.files):05d}.safetensors"
        save_file(self.current, os.path.join(self.out, name), metadata={"format": "pt"})
        self.files.append((name, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self) -> list[str]:
        if self.current or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            final = [("model.safetensors", self.files[0][1])]
        else:
            final = [
                (f"model-{i + 1:05d}-of-{n:05d}.safetensors", ks)
                for i, (_, ks) in enumerate(self.files)
            ]
        for (tmp, _), (name, _) in zip(self.files, final):
            os.replace(os.path.join(self.out, tmp), os.path.join(self.out, name))
        if n > 1:
            index = {
                "metadata": {"total_size": self.tensor_bytes},
                "weight_map": {k: name for name, ks in final for k in ks},
            }
            with open(os.path.join(self.out, "model.safetensors.index.json"), "w") as f:
                json.dump(index, f, indent=2)
        return [os.path.join(self.out, name) for name, _ in final]


@dataclass(slots=True)
class ExportReport:
    bytes_in: int  # tensor bytes of the source checkpoint
    bytes_out: int  # tensor bytes written
    files: list[str] = field(default_factory=list)
    quantized: list[str] = field(default_factory=list)  # module names
    ignored: list[str] = field(default_factory=list)  # linear modules left dense

    @property
    def ratio(self) -> float:
        return self.bytes_out / self.bytes_in


def export_compressed_tensors(
    src: str,
    out: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    quantize: Callable[[str, torch.Tensor], Int4Weight | None],
    group_size: int,
    symmetric: bool,
    bytes_in: int,
    out_dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
) -> ExportReport:
    """Stream `tensors` into `out`; `quantize(module, weight)` returns None to keep dense."""
    os.makedirs(out, exist_ok=True)
    writer = ShardWriter(out, shard_bytes)
    report = ExportReport(bytes_in, 0)
    for name, t in tensors:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        qw = quantize(module, t) if module and is_linear_weight(name, t.dim()) else None
        if qw is not None:
            for suffix, part in to_compressed_tensors(qw).items():
                writer.add(f"{module}.{suffix}", part)
            report.quantized.append(module)
            continue
        if module and is_linear_weight(name, t.dim()):
            report.ignored.append(module)
        writer.add(name, t.to(out_dtype) if t.is_floating_point() else t)
    report.files = writer.close()
    report.bytes_out = writer.tensor_bytes
    _write_config(
        src, out, compressed_tensors_config(group_size, symmetric, report.ignored), out_dtype
    )
    for f in AUX_FILES:
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), out)
    return report


def _write_config(src: str, out: str, qcfg: dict, dtype: torch.dtype) -> None:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qcfg
    key = "dtype" if "dtype" in cfg else "torch_dtype"
    cfg[key] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
