"""Fused MoE (Triton grouped GEMMs, interpreter) and the CPU sorted-layout path vs the
per-expert loop (`reference.fused_moe`), for dense, FP8-block and INT4 expert weights."""

from __future__ import annotations

import pytest
import torch

from slimserve_kernels import reference
from slimserve_kernels.moe_common import MoEWeights, align_rows, fused_moe_torch

pytestmark = pytest.mark.triton
fused = pytest.importorskip("slimserve_kernels.fused_moe_triton")

FP8 = torch.float8_e4m3fn
# Relative to max |out|: fp32 differs only in summation order; fp16 rounds x, the
# intermediate and gate/up once each (the loop rounds them too, at other points).
REL_TOL = {torch.float16: 4e-3, torch.float32: 2e-5}


def _int4(e, n, k, group, symmetric, gen):
    q = torch.randint(-(2**31), 2**31 - 1, (e, n, k // 8), dtype=torch.int32, generator=gen)
    s = torch.rand(e, n, k // group, generator=gen) * 0.02 + 0.005
    z = (
        None
        if symmetric
        else torch.randint(0, 16, (e, n, k // group), generator=gen).to(torch.uint8)
    )
    return q, s, z


def _fp8(e, n, k, block, gen):
    w = (torch.randn(e, n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    shape = (e, -(-n // block[0]), -(-k // block[1]))
    return w, torch.exp2(torch.randint(-12, -7, shape, generator=gen).float())


def weights(kind, e, h, inter, dtype, gen, group=32, symmetric=True, block=(32, 64)):
    if kind == "dense":
        w13 = (torch.randn(e, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
        w2 = (torch.randn(e, h, inter, generator=gen) / inter**0.5).to(dtype)
        return MoEWeights("dense", w13, w2)
    if kind == "fp8":
        (w13, s13), (w2, s2) = _fp8(e, 2 * inter, h, block, gen), _fp8(e, h, inter, block, gen)
        return MoEWeights("fp8", w13, w2, s13, s2, block=block)
    (w13, s13, z13), (w2, s2, z2) = (
        _int4(e, 2 * inter, h, group, symmetric, gen),
        _int4(e, h, inter, group, symmetric, gen),
    )
    return MoEWeights("int4", w13, w2, s13.to(dtype), s2.to(dtype), z13, z2, group=group)


def routing(t, e, k, gen, foreign=False):
    """Distinct experts per token; `foreign`: some ids belong to another EP rank (-1 / >= e)."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    if foreign:
        ids[::2, 0] = e + 1
        ids[1::3, -1] = -1
    w = torch.rand(t, k, generator=gen) + 0.1
    return w, ids


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < REL_TOL[dtype], err


CASES = [  # kind, H, I, extra
    ("dense", 72, 40, {}),
    ("fp8", 72, 40, dict(block=(32, 64))),
    ("fp8", 136, 72, dict(block=(128, 128))),
    ("int4", 96, 64, dict(group=32, symmetric=True)),
    ("int4", 128, 128, dict(group=128, symmetric=False)),
]


@pytest.mark.parametrize("kind,h,inter,extra", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("t,dtype", [(1, torch.float16), (7, torch.float32)])
def test_triton_matches_per_expert_loop(kind, h, inter, extra, t, dtype):
    gen = torch.Generator().manual_seed(t + h)
    w = weights(kind, 5, h, inter, dtype, gen, **extra)
    x = torch.randn(t, h, generator=gen).to(dtype)
    tw, ids = routing(t, 5, 3, gen, foreign=t > 1)
    _check(fused.fused_moe(x, tw, ids, w), reference.fused_moe(x, tw, ids, w), dtype)


@pytest.mark.parametrize("kind,h,inter,extra", CASES, ids=lambda c: str(c))
def test_cpu_path_matches_per_expert_loop(kind, h, inter, extra):
    gen = torch.Generator().manual_seed(h)
    w = weights(kind, 6, h, inter, torch.float32, gen, **extra)
    x = torch.randn(9, h, generator=gen)
    tw, ids = routing(9, 6, 2, gen, foreign=True)
    _check(fused_moe_torch(x, tw, ids, w), reference.fused_moe(x, tw, ids, w), torch.float32)


def test_forced_tiles_span_experts_and_padding():
    """BLOCK_M 16 with 23 tokens x top-4 over 3 experts: experts span several tiles, the last
    tile of each is padding. Guard: seen failing (err 0.72) with the tile's expert read as
    `pid_m % E` instead of `tile_expert[pid_m]`."""
    gen = torch.Generator().manual_seed(1)
    w = weights("fp8", 3, 72, 40, torch.float32, gen)
    x = torch.randn(23, 72, generator=gen)
    tw, ids = routing(23, 3, 2, gen)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4)
    out = fused.fused_moe(x, tw, ids, w, config=cfg)
    _check(out, reference.fused_moe(x, tw, ids, w), torch.float32)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_prefill_config_matches_per_expert_loop(kind):
    """66 tokens x top-8 = 528 pairs: the default prefill config (BLOCK_M 64, BLOCK_N 32)."""
    gen = torch.Generator().manual_seed(3)
    w = weights(kind, 8, 64, 64, torch.float32, gen)
    x = torch.randn(66, 64, generator=gen)
    tw, ids = routing(66, 8, 8, gen)
    assert fused.choose_config(ids.numel())["BLOCK_M"] == 64
    _check(fused.fused_moe(x, tw, ids, w), reference.fused_moe(x, tw, ids, w), torch.float32)


def test_align_rows_pads_each_expert_to_the_tile():
    ids = torch.tensor([[2, 0], [2, 7], [0, 2]])  # expert 7 is another rank's
    rows, tiles = align_rows(ids, 3, 4)
    s = ids.numel()
    # expert 0: rows 1, 4; expert 2: 0, 2, 5; then unused tiles up to the static bound
    # (cdiv(6, 4) + min(3, 6) = 5 tiles), marked -1.
    assert rows.tolist() == [1, 4, s, s, 0, 2, 5, s] + [s] * 12
    assert tiles.tolist() == [0, 2, -1, -1, -1]


def test_align_rows_never_syncs_with_the_host(monkeypatch):
    """A CUDA graph cannot record a read of a tensor's value on the host: align_rows (and the
    layout's size) must come from tensor ops and shapes alone. Every host read raises here."""
    gen = torch.Generator().manual_seed(5)
    _, ids = routing(40, 24, 6, gen)
    want_rows, want_tiles = align_rows(ids, 24, 16)

    def host_read(*a, **k):
        raise AssertionError("align_rows read a tensor's value on the host")

    for name in ("tolist", "item", "__int__", "__bool__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    rows, tiles = align_rows(ids, 24, 16)
    monkeypatch.undo()
    assert torch.equal(rows, want_rows) and torch.equal(tiles, want_tiles)
    unused = tiles.tolist().count(-1)
    assert 0 < unused < len(tiles)  # some unused tiles at the end, not all
