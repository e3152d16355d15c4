"""FP8 on the CPU through a table (slimserve_kernels/fp8_cpu.py) equals PyTorch's cast and the
reference block dequantization bit for bit."""

from __future__ import annotations

import pytest
import torch

from slimserve_kernels.fp8_cpu import dequantize_fp8_cpu, fp8_values
from slimserve_kernels.reference import dequantize_fp8_blocks

SHAPES = [  # N, K, block: tiled by 32x64 and 128x128 blocks, per channel, ragged (reference)
    ((96, 192), (32, 64)),
    ((256, 384), (128, 128)),
    ((40, 72), (1, 72)),
    ((136, 72), (128, 128)),
]


@pytest.mark.parametrize("shape,block", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_dequantization_equals_reference(shape, block, dtype):
    """Every byte pattern (NaN, subnormals, both zeros) under distinct block scales.
    Seen failing: the block scales read transposed, and a table built from float8_e5m2."""
    gen = torch.Generator().manual_seed(shape[0])
    codes = torch.arange(shape[0] * shape[1]) % 256
    codes = codes[torch.randperm(codes.numel(), generator=gen)].to(torch.uint8).view(shape)
    weight = codes.view(torch.float8_e4m3fn)
    scale_shape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.exp2(torch.randint(-12, 3, scale_shape, generator=gen).float())
    scale *= 1 + torch.rand(scale_shape, generator=gen)
    got = dequantize_fp8_cpu(weight, scale, block, dtype)
    want = dequantize_fp8_blocks(weight, scale, block, dtype)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_values_equal_the_cast_for_every_code(fp8, dtype):
    """The table lookup equals PyTorch's own cast bit for bit, for all 256 codes (NaNs
    included), in a non-contiguous gathered shape."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3).view(fp8)
    x = codes.view(2, 3, 2, 64)[:, ::2]  # non-contiguous, like a view of a gathered cache
    got, want = fp8_values(x, dtype), x.to(dtype)
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
