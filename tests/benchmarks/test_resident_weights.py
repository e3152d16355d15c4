"""bench/resident_weights.py at small shapes: what it counts, and FP8 checkpoints stay FP8 in
memory (<= 0.51x BF16 once the layer is big enough for 128 x 128 blocks to dominate)."""

from __future__ import annotations

import torch
from torch import nn

from bench.resident_weights import GLM45, measure_one, resident_bytes, write_checkpoint

# A GLM-4.5-shaped MoE layer, 8x smaller (H 640, I 256, 8 experts, top-8).
SMALL_GLM = GLM45 | dict(
    hidden_size=640,
    intermediate_size=1536,
    moe_intermediate_size=256,
    num_attention_heads=12,
    num_key_value_heads=1,
    n_routed_experts=8,
)


def test_views_count_once_and_rotary_tables_not_at_all():
    m = nn.Module()
    stack = torch.zeros(4, 8, 8)
    m.a, m.b = nn.Parameter(stack[0]), nn.Parameter(stack[1])  # two views of one stack
    m.register_buffer("cos", torch.zeros(100), persistent=False)
    m.packed = {"cpu": (torch.zeros(3, dtype=torch.uint8),)}  # a lazily built copy
    assert resident_bytes(m)["total"] == 4 * 8 * 8 * 4 + 3


def test_fp8_moe_layer_stays_fp8_and_int4_cpu_copy_counts(tmp_path):
    """Seen to fail: with prepare_quantized's FP8 module swap disabled (FP8 checkpoints
    dequantized on load, as before issue 16) FP8/BF16 was 1.0."""
    bf16 = write_checkpoint(SMALL_GLM, 8, str(tmp_path / "bf16"), fp8=False)
    fp8 = write_checkpoint(SMALL_GLM, 8, str(tmp_path / "fp8"), fp8=True)
    rows = {
        "bf16": measure_one(bf16, None, "cpu"),
        "fp8": measure_one(fp8, None, "cpu"),
        "int4": measure_one(bf16, "int4", "cpu"),
    }
    base = rows["bf16"]["after_load"]["total"]
    ratio = rows["fp8"]["after_load"]["total"] / base
    assert 0.49 < ratio <= 0.51, ratio
    assert rows["fp8"]["after_forward"] == rows["fp8"]["after_load"]  # no dense copy kept
    fp8_experts = rows["fp8"]["experts_after_load"]
    assert fp8_experts["float8_e4m3fn"] > 0.98 * fp8_experts["total"]
    int4 = rows["int4"]
    assert int4["after_load"]["total"] < 0.3 * base
    assert int4["after_forward"]["total"] > 1.8 * int4["after_load"]["total"]  # CPU int4pack
