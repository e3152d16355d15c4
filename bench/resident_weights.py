"""Weight bytes resident after loading, measured: one decoder layer at the real shapes of
Llama-3-8B (dense) and GLM-4.5 (MoE), written as BF16 and FP8-block checkpoints and loaded
through `app.quant.load.load_model` (the engine's loader), in three formats:

- BF16: the BF16 checkpoint.
- FP8-block: a DeepSeek-V3-style checkpoint (`weight` e4m3 + `weight_scale_inv`, 128 x 128
  blocks; router, norms, biases BF16), kept FP8 by the loader (`Fp8Linear`, FP8 expert stacks).
- INT4: the BF16 checkpoint loaded with `weight_quant="int4"` (RTN, symmetric, group 128;
  what `LLM(weight_quant="int4")` does).

Bytes: every distinct tensor storage reachable from the layer's modules (parameters,
persistent buffers, and tensors held in module attributes: the fused-MoE expert stacks, CPU
int4pack copies; not the rotary cos/sin tables, which are not weights): `after_load`, and
`after_forward` once every projection and the MoE block have run (lazily built copies then
exist: on CPU, PyTorch's int4pack layout beside each INT4 weight). On CUDA the allocator's
own delta (`torch.cuda.memory_allocated`) is recorded too.

GLM-4.5's MoE layer has 160 routed experts (7.5 GB in BF16, too much for a 2-core CI box):
the measured layer holds `experts` of them at the real shape, and the whole layer is
non-expert bytes + 160 x the measured bytes per expert (every expert has the same shapes);
both the measured and the extrapolated figures are written.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile

import torch
from safetensors.torch import save_file

from app.quant.fp8 import quantize_fp8_block

BLOCK = (128, 128)
LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    rope_theta=500000.0,
)
GLM45 = dict(
    architectures=["Glm4MoeForCausalLM"],
    model_type="glm4_moe",
    hidden_size=5120,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=160,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=0,
)
COMMON = dict(num_hidden_layers=1, vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-5)


def layer_tensors(cfg: dict, experts: int) -> dict[str, tuple[int, ...]]:
    """HF checkpoint name -> shape for layer 0 (+ embeddings, final norm, LM head)."""
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim", h // heads)
    p = "model.layers.0."
    t = {"model.embed_tokens.weight": (COMMON["vocab_size"], h), "model.norm.weight": (h,)}
    t["lm_head.weight"] = (COMMON["vocab_size"], h)
    t |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    for name, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
        t[p + f"self_attn.{name}_proj.weight"] = (rows, h)
        if cfg.get("attention_bias"):
            t[p + f"self_attn.{name}_proj.bias"] = (rows,)
    t[p + "self_attn.o_proj.weight"] = (h, heads * d)
    if cfg.get("use_qk_norm"):
        t |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if "n_routed_experts" not in cfg:
        return t | _mlp(p + "mlp.", h, cfg["intermediate_size"])
    t[p + "mlp.gate.weight"] = (experts, h)
    t[p + "mlp.gate.e_score_correction_bias"] = (experts,)
    inter = cfg["moe_intermediate_size"]
    t |= _mlp(p + "mlp.shared_experts.", h, inter * cfg["n_shared_experts"])
    for e in range(experts):
        t |= _mlp(p + f"mlp.experts.{e}.", h, inter)
    return t


def _mlp(prefix: str, h: int, inter: int) -> dict[str, tuple[int, int]]:
    return {
        prefix + "gate_proj.weight": (inter, h),
        prefix + "up_proj.weight": (inter, h),
        prefix + "down_proj.weight": (h, inter),
    }


def is_quantized_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Projections go FP8; embeddings, LM head, norms, biases and the router stay BF16."""
    return len(shape) == 2 and "layers." in name and not name.endswith("mlp.gate.weight")


def write_checkpoint(cfg: dict, experts: int, out: str, fp8: bool) -> str:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in layer_tensors(cfg, experts).items():
        w = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        if fp8 and is_quantized_linear(name, shape):
            q, sinv = quantize_fp8_block(w, BLOCK)
            tensors[name], tensors[name + "_scale_inv"] = q, sinv
        else:
            tensors[name] = w
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    config = {**COMMON, **cfg, "torch_dtype": "bfloat16"}
    if "n_routed_experts" in cfg:
        config["n_routed_experts"] = experts
    if fp8:
        config["quantization_config"] = dict(
            quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=BLOCK
        )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def _tensors_in(value, depth: int = 0):
    """Tensors held by a module attribute: directly, in tuples/lists/dicts, or in dataclass
    fields (MoEWeights, CpuInt4Pack); nn.Modules are walked by `modules()` instead."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth > 3 or isinstance(value, torch.nn.Module):
        return
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _tensors_in(v, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v, depth + 1)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, f.name), depth + 1)


def resident_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Distinct storages reachable from `module` -> {"total", per dtype name}."""
    seen: dict[int, tuple[int, str]] = {}
    for m in module.modules():
        found = list(m.parameters(recurse=False))
        found += [
            b for n, b in m.named_buffers(recurse=False) if n not in m._non_persistent_buffers_set
        ]
        for name, v in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                found += list(_tensors_in(v))
        for t in found:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (s.nbytes(), str(t.dtype).removeprefix("torch.")))
    out: dict[str, int] = {"total": sum(n for n, _ in seen.values())}
    for n, dtype in seen.values():
        out[dtype] = out.get(dtype, 0) + n
    return out


@torch.no_grad()
def touch(layer: torch.nn.Module, hidden: int, device) -> None:
    """One forward of every projection and of the MoE block (builds lazy copies/stacks)."""
    for m in layer.modules():
        if hasattr(m, "fused_weights"):  # the MoE block: router, stacks, experts, shared
            m(torch.randn(4, hidden, device=device, dtype=torch.bfloat16))
        elif hasattr(m, "in_features"):  # every projection, each expert's too
            m(torch.randn(2, m.in_features, device=device, dtype=torch.bfloat16))


def measure_one(path: str, weight_quant: str | None, device: str) -> dict:
    from app.quant import apply_weight_quant
    from app.quant.load import load_model

    gc.collect()
    cuda = device.startswith("cuda")
    before = torch.cuda.memory_allocated() if cuda else 0
    model, cfg = load_model(path, torch.bfloat16, device)
    apply_weight_quant(model, cfg, weight_quant)
    layer = model.model.layers[0]
    experts = getattr(layer.mlp, "experts", None)
    row = dict(after_load=resident_bytes(layer))
    if experts is not None:
        row["experts_after_load"] = resident_bytes(experts)
    if cuda:
        torch.cuda.synchronize()
        row["cuda_allocated_model"] = torch.cuda.memory_allocated() - before
    touch(layer, cfg.hidden_size, device)
    row["after_forward"] = resident_bytes(layer)
    if experts is not None:
        row["experts_after_forward"] = resident_bytes(experts)
    del model, layer, experts
    gc.collect()
    return row


FORMATS = {"BF16": (False, None), "FP8-block": (True, None), "INT4 g128": (False, "int4")}


def measure(experts: int = 8, device: str = "cpu", keep: str | None = None) -> dict:
    """{layer: {format: row}}; MoE rows add `layer_full_160_experts` (extrapolated)."""
    results = {}
    for layer_name, cfg in (("Llama-3-8B dense layer", LLAMA3_8B), ("GLM-4.5 MoE layer", GLM45)):
        with tempfile.TemporaryDirectory(dir=keep) as tmp:
            paths = {
                fp8: write_checkpoint(cfg, experts, os.path.join(tmp, f"fp8={fp8}"), fp8)
                for fp8 in (False, True)
            }
            rows = {}
            for fmt, (fp8, wq) in FORMATS.items():
                row = measure_one(paths[fp8], wq, device)
                if "experts_after_load" in row:
                    row |= _extrapolate(row, experts, cfg["n_routed_experts"])
                rows[fmt] = row
                print(f"{layer_name} {fmt}: {row['after_load']['total'] / 2**20:.1f} MiB")
            results[layer_name] = rows
    return results


def _extrapolate(row: dict, measured: int, full: int) -> dict:
    """Layer bytes with all `full` experts: measured layer + (full - measured) x per expert."""
    out = {}
    for when in ("after_load", "after_forward"):
        per = row[f"experts_{when}"]["total"] / measured
        out[f"{when}_full_{full}_experts"] = int(row[when]["total"] + (full - measured) * per)
    return out


def _total(v) -> int:
    return v["total"] if isinstance(v, dict) else v


def markdown(results: dict) -> str:
    """One row per (layer, format): MiB after load, x BF16, MiB after a CPU forward; MoE
    layers also with all their experts (extrapolated from the measured per-expert bytes)."""
    lines = [
        "| layer | format | resident after load | vs BF16 | after a CPU forward |",
        "|---|---|---:|---:|---:|",
    ]
    for layer, rows in results.items():
        fulls = [k.removeprefix("after_load") for k in rows["BF16"] if k.startswith("after_load_")]
        for suffix in ["", *fulls]:
            label = layer
            if suffix:
                label += f" ({suffix.strip('_').replace('_', ' ')}, extrapolated)"
            elif "experts_after_load" in rows["BF16"]:
                label += " (as measured: 8 experts)"
            base = _total(rows["BF16"]["after_load" + suffix])
            for fmt, row in rows.items():
                load, fwd = (_total(row[w + suffix]) for w in ("after_load", "after_forward"))
                lines.append(
                    f"| {label} | {fmt} | {load / 2**20:,.1f} MiB | {load / base:.3f}x "
                    f"| {fwd / 2**20:,.1f} MiB |"
                )
    return "\n".join(lines)
