"""Checkpoint size, BF16 vs FP8 (block-scaled) vs INT4 (compressed-tensors, g32/g128), measured
as safetensors files on disk for real layer shapes of Llama-3-8B and GLM-4.5-Air.

One decoder layer of each is materialized with random weights, converted to each format and
written with safetensors; the file sizes are measured. GLM-4.5-Air's MoE layer is written
as its non-expert part (attention, shared expert, router, norms) plus one routed expert, and
the layer is non-expert + 128 x expert (every expert has the same shapes). Whole-model
figures multiply the measured layer by the layer count and add BF16 embeddings / LM head
(kept unquantized); they are estimates, labelled as such.

    python bench/checkpoint_size.py      # -> bench/results/checkpoint_size.json
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.quant.fp8 import quantize_fp8_block  # noqa: E402
from app.quant.int4 import quantize_rtn  # noqa: E402
from app.quant.layouts import to_compressed_tensors  # noqa: E402
from bench.common import write_json  # noqa: E402

FORMATS = ("bf16", "fp8", "int4-g128", "int4-g128-asym", "int4-g32")
H = 4096


def llama3_8b_layer() -> tuple[dict, list]:
    """(linear name -> [N, K], norm names) of one Llama-3-8B decoder layer."""
    lin = {
        "self_attn.q_proj": (4096, H),
        "self_attn.k_proj": (1024, H),
        "self_attn.v_proj": (1024, H),
        "self_attn.o_proj": (H, 4096),
        "mlp.gate_proj": (14336, H),
        "mlp.up_proj": (14336, H),
        "mlp.down_proj": (H, 14336),
    }
    return lin, ["input_layernorm", "post_attention_layernorm"]


def glm45_air_nonexpert() -> tuple[dict, list]:
    """GLM-4.5-Air MoE layer without routed experts: 96 q heads, 8 KV heads, head_dim 128."""
    lin = {
        "self_attn.q_proj": (96 * 128, H),
        "self_attn.k_proj": (8 * 128, H),
        "self_attn.v_proj": (8 * 128, H),
        "self_attn.o_proj": (H, 96 * 128),
        "mlp.shared_experts.gate_proj": (1408, H),
        "mlp.shared_experts.up_proj": (1408, H),
        "mlp.shared_experts.down_proj": (H, 1408),
    }
    router = {"mlp.gate": (128, H)}  # kept in BF16, as releases do
    return lin | router, ["input_layernorm", "post_attention_layernorm"]


def glm45_air_expert() -> tuple[dict, list]:
    lin = {"mlp.experts.0.gate_proj": (1408, H), "mlp.experts.0.up_proj": (1408, H)}
    return lin | {"mlp.experts.0.down_proj": (H, 1408)}, []


def convert(name: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "bf16" or name.endswith("mlp.gate"):
        return {f"{name}.weight": w}
    if fmt == "fp8":
        q, sinv = quantize_fp8_block(w, (128, 128))
        return {f"{name}.weight": q, f"{name}.weight_scale_inv": sinv}
    group = 32 if fmt.endswith("g32") else 128
    qw = quantize_rtn(w, group, symmetric=not fmt.endswith("asym"), scale_dtype=torch.bfloat16)
    return {f"{name}.{k}": v for k, v in to_compressed_tensors(qw).items()}


def file_bytes(part: tuple[dict, list], fmt: str, seed: int = 0) -> int:
    linears, norms = part
    g = torch.Generator().manual_seed(seed)
    tensors = {f"{n}.weight": torch.ones(H, dtype=torch.bfloat16) for n in norms}
    for name, shape in linears.items():
        w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
        tensors.update(convert(name, w, fmt))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "layer.safetensors")
        save_file(tensors, path)
        return os.path.getsize(path)


def main() -> None:
    rows = {}
    for fmt in FORMATS:
        llama = file_bytes(llama3_8b_layer(), fmt)
        glm = file_bytes(glm45_air_nonexpert(), fmt) + 128 * file_bytes(glm45_air_expert(), fmt)
        rows[fmt] = {"llama3_8b_layer": llama, "glm45_air_moe_layer": glm}
        print(
            f"{fmt:<16} llama3-8b layer {llama / 2**20:8.1f} MiB   "
            f"glm-4.5-air layer {glm / 2**20:8.1f} MiB",
            flush=True,
        )
    embed = {"llama3_8b": 2 * 128256 * H * 2, "glm45_air": 2 * 151552 * H * 2}  # bf16 in+out
    models = {
        fmt: {
            "llama3_8b_estimate": 32 * r["llama3_8b_layer"] + embed["llama3_8b"],
            "glm45_air_estimate": 46 * r["glm45_air_moe_layer"] + embed["glm45_air"],
        }
        for fmt, r in rows.items()
    }
    vs_fp8 = {fmt: {k: rows[fmt][k] / rows["fp8"][k] - 1 for k in rows[fmt]} for fmt in FORMATS}
    path = write_json(
        "checkpoint_size", {"layers_bytes": rows, "models_bytes": models, "change_vs_fp8": vs_fp8}
    )
    print(f"wrote {path}")
    for fmt in FORMATS:
        print(
            f"{fmt:<16} vs FP8: llama layer {100 * vs_fp8[fmt]['llama3_8b_layer']:+.1f}%  "
            f"glm layer {100 * vs_fp8[fmt]['glm45_air_moe_layer']:+.1f}%"
        )


if __name__ == "__main__":
    main()
