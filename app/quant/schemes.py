"""`quantization_config` (config.json) -> what the loader must do, or a clear ValueError.

Supported: compressed-tensors (`pack-quantized` INT4 group/channel, sym or asym, optional
actorder; `float-quantized` and `naive-quantized` dequantized on load), GPTQ (4 bit, v1/v2
zero points, desc_act), AWQ (GEMM, 4 bit) and FP8 block-scaled (`quant_method: fp8` with
`weight_block_size`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

COMPRESSED_TENSORS_FORMATS = ("pack-quantized", "float-quantized", "naive-quantized")


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    group_size: int
    symmetric: bool
    act_order: bool = False


@dataclass(slots=True)
class QuantPlan:
    method: str  # compressed-tensors | gptq | awq | fp8
    fmt: str  # pack-quantized | float-quantized | naive-quantized | gptq | awq | fp8-block
    symmetric: bool = True
    group_size: int | None = None  # None: one group per row (channel-wise)
    act_order: bool = False
    zeros_offset: int = 0
    block_size: tuple[int, int] | None = None
    groups: list[tuple[list[str], dict[str, Any]]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"quant_method={self.method!r} format={self.fmt!r}"

    def scheme_for(self, prefix: str, shapes: dict[str, tuple[int, ...]], marker: str):
        """The INT4 scheme of one checkpoint module, checked against its tensor shapes."""
        sym, group = self.symmetric, self.group_size
        if self.groups:
            args = _matching_group(self.groups, self.ignore, prefix)
            sym, group = bool(args.get("symmetric", True)), _ct_group_size(args)
        if self.fmt == "pack-quantized":
            n, k8 = shapes[f"{prefix}.weight_packed"]
            k, scale_groups = k8 * 8, shapes[f"{prefix}.weight_scale"][-1]
        else:  # gptq / awq: qweight [K/8, N] or [K, N/8], scales [K/g, N]
            qshape = shapes[f"{prefix}.qweight"]
            k = qshape[0] * 8 if self.fmt == "gptq" else qshape[0]
            scale_groups = shapes[f"{prefix}.scales"][0]
        group = group or k
        if k % group or k // group != scale_groups:
            raise ValueError(
                f"{prefix}: {self.describe()} group_size={group} does not fit its tensors "
                f"(in_features={k}, {scale_groups} scale groups)"
            )
        return Int4Scheme(group, sym)


def _matches(target: str, prefix: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return prefix == target or prefix.endswith("." + target)


def _matching_group(groups, ignore: list[str], prefix: str) -> dict[str, Any]:
    if any(_matches(t, prefix) for t in ignore):
        raise ValueError(f"{prefix} is in the quantization ignore list but has quantized tensors")
    for targets, args in groups:
        # "Linear" (a class name) matches every linear; checkpoint tensors decide which are.
        if any(t == "Linear" or _matches(t, prefix) for t in targets):
            return args
    raise ValueError(f"{prefix} has quantized tensors but matches no config_groups target")


def _ct_group_size(args: dict[str, Any]) -> int | None:
    strategy = args.get("strategy")
    if strategy == "group":
        return int(args["group_size"])
    if strategy == "channel":
        return None
    raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported for INT4")


def _compressed_tensors(cfg: dict[str, Any]) -> QuantPlan:
    groups = cfg.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    formats = sorted({str(g.get("format") or cfg.get("format")) for g in groups.values()})
    fmt = formats[0]
    if len(formats) != 1 or fmt not in COMPRESSED_TENSORS_FORMATS:
        raise ValueError(
            f"compressed-tensors format(s) {formats} not supported (one of "
            f"{COMPRESSED_TENSORS_FORMATS} for all config_groups)"
        )
    plan = QuantPlan("compressed-tensors", fmt, ignore=list(cfg.get("ignore") or []))
    for name, group in groups.items():
        w = group.get("weights") or {}
        if fmt == "pack-quantized":
            if w.get("type") != "int" or w.get("num_bits") != 4:
                found = f"type={w.get('type')!r} num_bits={w.get('num_bits')!r}"
                raise ValueError(f"pack-quantized group {name}: only int 4-bit, found {found}")
            if group.get("input_activations"):
                raise ValueError(f"group {name} quantizes activations; only W4A16 is supported")
            _ct_group_size(w)
            plan.act_order = plan.act_order or w.get("actorder") == "group"
        elif fmt == "float-quantized":
            _fp8_weights(name, w, plan)
        plan.groups.append((list(group.get("targets") or []), w))
    return plan


def _fp8_weights(name: str, w: dict[str, Any], plan: QuantPlan) -> None:
    """float-quantized weights are FP8 e4m3, per tensor/channel or in blocks (the checkpoint's
    input activation scheme, if configured, is not applied: `fp8_activations` decides)."""
    if w.get("type") != "float" or w.get("num_bits") != 8:
        found = f"type={w.get('type')!r} num_bits={w.get('num_bits')!r}"
        raise ValueError(f"float-quantized group {name}: only float 8-bit, found {found}")
    strategy = w.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"float-quantized group {name}: strategy {strategy!r} not supported")
    if strategy == "block":
        block = tuple(int(b) for b in w.get("block_structure") or ())
        if len(block) != 2 or plan.block_size not in (None, block):
            raise ValueError(f"float-quantized group {name}: block_structure {block!r}")
        plan.block_size = block


def _gptq(cfg: dict[str, Any]) -> QuantPlan:
    bits = cfg.get("bits")
    if bits != 4:
        raise ValueError(f"GPTQ with bits={bits!r}: only 4-bit is supported")
    ckpt = cfg.get("checkpoint_format", "gptq")
    if ckpt not in ("gptq", "gptq_v2") or cfg.get("is_marlin_format"):
        raise ValueError(f"GPTQ checkpoint_format {ckpt!r} is not supported (gptq, gptq_v2)")
    group = int(cfg.get("group_size", 128))
    return QuantPlan(
        "gptq",
        "gptq",
        symmetric=bool(cfg.get("sym", True)),
        group_size=None if group == -1 else group,
        act_order=bool(cfg.get("desc_act", False)),
        zeros_offset=1 if ckpt == "gptq" else 0,
    )


def _awq(cfg: dict[str, Any]) -> QuantPlan:
    bits = cfg.get("bits", cfg.get("w_bit"))
    version = str(cfg.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not cfg.get("zero_point", True):
        found = f"bits={bits!r} version={version!r} zero_point={cfg.get('zero_point', True)!r}"
        raise ValueError(f"AWQ {found}: only 4-bit GEMM with zero points is supported")
    group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    return QuantPlan("awq", "awq", symmetric=False, group_size=group)


def _fp8(cfg: dict[str, Any]) -> QuantPlan:
    block = cfg.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError(f"fp8 quantization_config needs weight_block_size [bn, bk], got {block!r}")
    if cfg.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 fmt {cfg.get('fmt')!r} is not supported (e4m3)")
    return QuantPlan("fp8", "fp8-block", block_size=(int(block[0]), int(block[1])))


PARSERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq, "fp8": _fp8}


def parse_quantization_config(cfg: dict[str, Any]) -> QuantPlan:
    method = str(cfg.get("quant_method", "")).lower()
    if method not in PARSERS:
        raise ValueError(
            f"unsupported quantization_config quant_method={cfg.get('quant_method')!r}; "
            f"supported: {sorted(PARSERS)}"
        )
    return PARSERS[method](cfg)


def is_int4(cfg: dict[str, Any] | None) -> bool:
    """Whether a checkpoint with this quantization_config already holds INT4 weights."""
    return bool(cfg) and parse_quantization_config(cfg).fmt in ("pack-quantized", "gptq", "awq")
