"""Triton kv_write vs reference.kv_write: the same bits in cache and scales."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import FP8, empty_cache, random_kv

from slimserve_kernels import reference

pytestmark = pytest.mark.triton
kv_write_triton = pytest.importorskip("slimserve_kernels.kv_write_triton").kv_write


def _bits(t: torch.Tensor | None):
    return None if t is None else (t.view(torch.uint8) if t.dtype == FP8 else t)


def _write_both(k, v, slots, dtype, num_blocks=6, block_size=4):
    caches = []
    for fn in (reference.kv_write, kv_write_triton):
        cache = empty_cache(dtype, num_blocks, block_size, k.shape[1], k.shape[2])
        fn(k, v, *cache.args(), slots)
        caches.append(cache)
    return caches


@pytest.mark.parametrize("dtype", [FP8, torch.float16, torch.float32])
@pytest.mark.parametrize("src_dtype", [torch.float16, torch.float32])
def test_kv_write_matches_reference(dtype, src_dtype):
    gen = torch.Generator().manual_seed(1)
    k, v = random_kv(7, 3, 24, gen)  # D=24: not a power of two
    k[2] = 0.0  # an all-zero row takes the exponent floor
    k[4, 1] *= 300.0  # a large row (still finite in fp16)
    slots = torch.tensor([3, 9, -1, 0, 22, 17, 5])  # -1: skipped (padding token)
    ref, tri = _write_both(k.to(src_dtype), v.to(src_dtype), slots, dtype)
    for a, b in zip(ref.args(), tri.args()):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(_bits(a), _bits(b))
    if dtype == FP8:
        assert (ref.k_scale.view(-1, 3)[slots[slots >= 0]] != 0).any()


def test_fp8_rounds_to_nearest_even_at_every_tie():
    """Midpoints between adjacent e4m3 values (normal and subnormal) must round to even."""
    codes = torch.arange(0, 0x7E, dtype=torch.uint8)  # 0 .. 416 (0x7E = 448 is the max)
    vals = codes.view(FP8).float()
    mids = (vals[:-1] + vals[1:]) / 2  # 125 ties, exact in fp32
    row = torch.cat([torch.tensor([448.0]), mids, -mids, vals[1:] * 1.01])  # amax 448 -> e=0
    k = row.view(1, 1, -1).repeat(2, 1, 1)
    k[1] *= 2.0**-20  # same ties under a small scale
    ref, tri = _write_both(k, k.clone(), torch.tensor([1, 6]), FP8)
    assert torch.equal(_bits(ref.k), _bits(tri.k))
    assert torch.equal(ref.k_scale, tri.k_scale)
    assert ref.k_scale.view(-1)[1].item() == 0 and ref.k_scale.view(-1)[6].item() == -20


def test_fp8_scale_exponent_boundaries():
    """amax exactly 448 * 2**e, and one ulp above it, land on e and e + 1 like the reference."""
    amax = torch.tensor([448.0, 448.0 * 2**-7, 1.0, 3e-38, 0.0, 6e4])
    above = torch.nextafter(amax, torch.full_like(amax, float("inf")))
    k = torch.zeros(12, 1, 8)
    k[:6, 0, 3] = amax
    k[6:, 0, 3] = above
    ref, tri = _write_both(k, k.clone(), torch.arange(12), FP8, num_blocks=3)
    assert torch.equal(ref.k_scale, tri.k_scale)
    assert torch.equal(_bits(ref.k), _bits(tri.k))
