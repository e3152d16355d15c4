"""Paged decode attention's grouped kernel: constant non-trivial FP8 scales (k 0.5, v 0.25),
GQA ratios > 1, many blocks, the device-sized split path and the single pass, odd shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ATTN_TOL, FP8, block_tables

from slimserve_kernels import reference

pytestmark = pytest.mark.triton
decode = pytest.importorskip("slimserve_kernels.paged_decode")


def _cache(dtype, num_blocks, bs, hkv, d, gen, k_exp=-1, v_exp=-2):
    """A cache of random values; FP8 with every K scale 2**k_exp and V scale 2**v_exp."""
    k = (torch.randn(num_blocks, bs, hkv, d, generator=gen) * 4).to(dtype)
    v = (torch.randn(num_blocks, bs, hkv, d, generator=gen) * 4).to(dtype)
    if dtype != FP8:
        return k, v, None, None
    ks = torch.full((num_blocks, bs, hkv), k_exp, dtype=torch.int8)
    return k, v, ks, torch.full_like(ks, v_exp)


def _run(dtype, q_dtype, lens, hq, hkv, d, bs, num_blocks, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    cache = _cache(dtype, num_blocks, bs, hkv, d, gen)
    table = block_tables(lens, bs, num_blocks, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(q_dtype)
    args = (q, *cache, table, torch.tensor(lens, dtype=torch.int32), d**-0.5)
    out = decode.paged_decode_attention(*args, **kw)
    atol, rtol = ATTN_TOL[q_dtype]
    ref = reference.paged_decode_attention(*args)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out, args


@pytest.mark.parametrize("dtype", [FP8, torch.float16])
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_heuristic_splits_on_device(dtype, q_dtype):
    """The heuristic path: the grid has 2 splits (600-token bound); the 600-token sequence
    takes both, the 100-token one only its first (sized in-kernel). 150 + 25 blocks of 4."""
    bs, lens = 4, [600, 100]
    assert decode.choose_num_splits(2, 2, 150 * bs) == 2
    _run(dtype, q_dtype, lens, 8, 2, 64, bs, 180, seed=1)


@pytest.mark.parametrize("dtype", [FP8, torch.float16])
def test_single_pass_odd_shapes(dtype):
    """One split, GQA 3, D = 40 (padded), block size 5, lengths not multiples of anything."""
    out, _ = _run(dtype, torch.float32, [1, 77, 131], 9, 3, 40, 5, 70, seed=2, num_splits=1)
    assert out.shape == (3, 9, 40)


def test_forced_splits_equal_single_pass():
    _, args = _run(FP8, torch.float32, [300, 45], 16, 2, 32, 16, 24, seed=3, num_splits=5)
    one = decode.paged_decode_attention(*args, num_splits=1)
    five = decode.paged_decode_attention(*args, num_splits=5)
    torch.testing.assert_close(one, five, atol=2e-5, rtol=2e-5)


def test_scales_are_applied():
    """Guards the scale test: k 0.5 / v 0.25 read as 1 / 1 is far outside the tolerance."""
    out, args = _run(FP8, torch.float32, [90], 4, 1, 32, 16, 8, seed=4)
    q, k, v, ks, vs, table, lens, scale = args
    unscaled = reference.paged_decode_attention(q, k, v, ks * 0, vs * 0, table, lens, scale)
    assert (out - unscaled).abs().max() > 0.1
