"""Quantized tiny checkpoints for the tests, each with a dense "twin" holding exactly the
weights the quantized one decodes to.

- compressed-tensors: produced by the compressed-tensors library itself.
- GPTQ and AWQ: packed here by code written from the published layouts (AutoGPTQ's and
  AutoAWQ's `pack()`), deliberately independent of app/quant, with plain integer loops.
- FP8 block-scaled: DeepSeek-V3 style `weight` + `weight_scale_inv`.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _copy_aux(src: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), out)


def _write(out: str, src: str, tensors: dict, quantization_config: dict | None) -> str:
    _copy_aux(src, out)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors")
    )
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def _linear_names(state: dict) -> list[str]:
    return sorted(
        k[: -len(".weight")]
        for k in state
        if k.endswith(".weight") and k.split(".")[-2] in LINEAR_SUFFIXES
    )


def make_compressed_tensors(
    src: str,
    out: str,
    symmetric: bool,
    group_size: int | None = 32,
    num_bits: int = 4,
    kind: str = "int",
    fmt: str = "pack-quantized",
) -> str:
    """Quantize `src` with compressed-tensors (weight-only, group or channel) and save it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    strategy = "group" if group_size else "channel"
    args = QuantizationArgs(
        num_bits=num_bits, type=kind, symmetric=symmetric, strategy=strategy, group_size=group_size
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):  # what an observer would do: min/max per group
                n, k = m.weight.shape
                wg = m.weight.view(n, k // (group_size or k), group_size or k)
                s, z = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
                m.weight_scale.copy_(s.to(m.weight_scale.dtype))
                if hasattr(m, "weight_zero_point"):
                    m.weight_zero_point.copy_(z.to(m.weight_zero_point.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_aux(src, out)
    return out


def hf_dequantized_logits(path: str, ids: list[int]) -> torch.Tensor:
    """Logits of the compressed-tensors library's own dequantized model (transformers)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _asym_groups(w: torch.Tensor, g_idx: np.ndarray, ngroups: int):
    """Independent asymmetric 4-bit quantizer: per (row, group) min/max -> codes, s, z."""
    n, k = w.shape
    scales = torch.zeros(ngroups, n)
    zeros = torch.zeros(ngroups, n, dtype=torch.int64)
    codes = torch.zeros(k, n, dtype=torch.int64)
    for grp in range(ngroups):
        cols = np.nonzero(g_idx == grp)[0]
        block = w[:, cols]
        lo = torch.clamp(block.min(1).values, max=0)
        hi = torch.clamp(block.max(1).values, min=0)
        s = (hi - lo) / 15
        z = torch.round(-lo / s)
        q = torch.clamp(torch.round(block / s[:, None]) + z[:, None], 0, 15)
        scales[grp], zeros[grp] = s, z.long()
        codes[cols] = q.long().T
    return codes, scales, zeros  # [K, N], [G, N], [G, N]


def _pack_rows(values: np.ndarray, order=range(8)) -> np.ndarray:
    """[R, C] ints -> [R/8, C] int32: word r holds rows 8r + order[i] in nibble i."""
    out = np.zeros((values.shape[0] // 8, values.shape[1]), dtype=np.uint32)
    for r in range(out.shape[0]):
        for i, j in enumerate(order):
            out[r] |= values[8 * r + j].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def _twin_weight(codes, scales, zeros, g_idx) -> torch.Tensor:
    gi = torch.as_tensor(g_idx, dtype=torch.long)
    return ((codes.float() - zeros[gi].float()) * scales[gi]).T.contiguous()  # [N, K]


def _sym_groups(w: torch.Tensor, g_idx: np.ndarray, ngroups: int):
    """Independent symmetric 4-bit quantizer as AutoGPTQ's `sym=True`: per (row, group)
    xmax = max|w|, scale = 2 * xmax / 15, zero = 8, codes = clamp(round(w / s) + 8, 0, 15)."""
    n, k = w.shape
    scales = torch.zeros(ngroups, n)
    codes = torch.zeros(k, n, dtype=torch.int64)
    for grp in range(ngroups):
        cols = np.nonzero(g_idx == grp)[0]
        s = w[:, cols].abs().max(1).values.clamp_min(1e-8) * 2 / 15
        codes[cols] = torch.clamp(torch.round(w[:, cols] / s[:, None]) + 8, 0, 15).long().T
        scales[grp] = s
    return codes, scales, torch.full((ngroups, n), 8, dtype=torch.int64)


def make_gptq(
    src: str,
    out: str,
    twin: str,
    group_size: int,
    desc_act: bool,
    seed: int = 0,
    symmetric: bool = False,
):
    """AutoGPTQ v1 layout: qweight [K/8, N] packed along K, qzeros stored as z - 1 (7 for
    every group when `symmetric`, as AutoGPTQ writes sym=True checkpoints)."""
    state = load_file(os.path.join(src, "model.safetensors"))
    rng = np.random.default_rng(seed)
    tensors, dense, orders = {}, dict(state), {}
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight").float()
        k = w.shape[1]
        g_idx = np.arange(k) // group_size
        if desc_act:  # columns visited in a random order get consecutive groups; layers
            # that read the same input (q/k/v, gate/up) share it, as GPTQ's H is theirs too
            shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
            shared = shared.replace("up_proj", "gate_proj")
            order = orders.setdefault(shared, rng.permutation(k))
            g_idx = np.empty(k, dtype=np.int64)
            g_idx[order] = np.arange(k) // group_size
        quantizer = _sym_groups if symmetric else _asym_groups
        codes, scales, zeros = quantizer(w, g_idx, k // group_size)
        tensors[f"{name}.qweight"] = torch.from_numpy(_pack_rows(codes.numpy()))
        stored = ((zeros - 1) & 0xF).numpy().T  # [N, G] -> pack along N
        tensors[f"{name}.qzeros"] = torch.from_numpy(_pack_rows(stored).T.copy())
        tensors[f"{name}.scales"] = scales.half()
        tensors[f"{name}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
        dense[f"{name}.weight"] = _twin_weight(codes, scales.half().float(), zeros, g_idx)
    tensors.update(state)
    cfg = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act}
    cfg.update(sym=symmetric, checkpoint_format="gptq")
    return _write(out, src, tensors, cfg), _write(twin, src, dense, None)


def make_awq(src: str, out: str, twin: str, group_size: int):
    """AutoAWQ GEMM layout: qweight [K, N/8] packed along N in AWQ_ORDER."""
    state = load_file(os.path.join(src, "model.safetensors"))
    tensors, dense = {}, dict(state)
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight").float()
        k = w.shape[1]
        g_idx = np.arange(k) // group_size
        codes, scales, zeros = _asym_groups(w, g_idx, k // group_size)
        # pack along N: transpose so N is the row axis, pack, transpose back
        tensors[f"{name}.qweight"] = torch.from_numpy(
            _pack_rows(codes.numpy().T, AWQ_ORDER).T.copy()
        )
        tensors[f"{name}.qzeros"] = torch.from_numpy(
            _pack_rows(zeros.numpy().T, AWQ_ORDER).T.copy()
        )
        tensors[f"{name}.scales"] = scales.half()
        dense[f"{name}.weight"] = _twin_weight(codes, scales.half().float(), zeros, g_idx)
    tensors.update(state)
    cfg = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True}
    cfg["version"] = "gemm"
    return _write(out, src, tensors, cfg), _write(twin, src, dense, None)


def make_fp8_block(src: str, out: str, twin: str, block: tuple[int, int] = (32, 32)):
    """DeepSeek-V3 style: fp8 weight, weight_scale_inv [ceil(N/bn), ceil(K/bk)] multiplies."""
    state = load_file(os.path.join(src, "model.safetensors"))
    tensors, dense = {}, dict(state)
    bn, bk = block
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight").float()
        n, k = w.shape
        sinv = torch.zeros(-(-n // bn), -(-k // bk))
        q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
        deq = torch.zeros(n, k)
        for i in range(sinv.shape[0]):
            for j in range(sinv.shape[1]):
                blk = w[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk]
                sinv[i, j] = blk.abs().max() / 448.0
                qb = (blk / sinv[i, j]).to(torch.float8_e4m3fn)
                q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = qb
                deq[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = qb.float() * sinv[i, j]
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"] = q, sinv
        dense[f"{name}.weight"] = deq
    tensors.update(state)
    cfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    cfg["weight_block_size"] = list(block)
    return _write(out, src, tensors, cfg), _write(twin, src, dense, None)


def make_compressed_tensors_fp8_block(src: str, out: str, block: tuple[int, int]) -> str:
    """compressed-tensors' FP8 block scheme (weights e4m3, one scale per block, as its
    FP8_BLOCK preset), quantized and saved by the library itself (`float-quantized`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="block", block_structure=list(block)
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    bn, bk = block
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "weight_scale"):  # what its observer does: amax / 448 per block
                n, k = m.weight.shape
                pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
                pad[:n, :k] = m.weight.abs()
                amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax((1, 3))
                m.weight_scale.copy_((amax / 448.0).to(m.weight_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_aux(src, out)
    return out
