"""quantization_config parsing: a Kimi-K2-style compressed-tensors config, and clear errors."""

import pytest

from app.quant.schemes import Int4Scheme, is_int4, parse_quantization_config

KIMI_K2_STYLE = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
            },
        }
    },
    # routed experts INT4; attention, shared experts and dense MLPs stay in higher precision
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.down_proj"],
}


def shapes_for(prefix: str, n: int, k: int, group: int) -> dict:
    return {f"{prefix}.weight_packed": (n, k // 8), f"{prefix}.weight_scale": (n, k // group)}


def test_kimi_k2_style_config():
    plan = parse_quantization_config(KIMI_K2_STYLE)
    assert plan.fmt == "pack-quantized" and is_int4(KIMI_K2_STYLE)
    expert = "model.layers.3.mlp.experts.7.down_proj"
    shapes = shapes_for(expert, 7168, 2048, 32)
    assert plan.scheme_for(expert, shapes, "weight_packed") == Int4Scheme(32, True)
    attn = "model.layers.3.self_attn.q_b_proj"
    with pytest.raises(ValueError, match="ignore list"):
        plan.scheme_for(attn, shapes_for(attn, 512, 1536, 32), "weight_packed")
    with pytest.raises(ValueError, match="group_size=32 does not fit"):
        plan.scheme_for(expert, shapes_for(expert, 7168, 2048, 128), "weight_packed")


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({}, "quant_method=None"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "marlin-24",
                "config_groups": {"g": {}},
            },
            "format.*marlin-24.*not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}},
            },
            "only int 4-bit, found type='int' num_bits=8",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}
                },
            },
            "strategy 'tensor'",
        ),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "e5m2"),
    ],
)
def test_unsupported_configs_name_what_they_found(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_quantization_config(cfg)


def test_dense_formats_are_not_int4():
    assert not is_int4({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert not is_int4(None)
    assert is_int4({"quant_method": "awq", "bits": 4, "version": "gemm"})
