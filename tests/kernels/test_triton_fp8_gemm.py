"""Triton W8A16 FP8 GEMM (block, per-channel and per-row scales) vs reference.fp8_gemm."""

from __future__ import annotations

import pytest
import torch

from slimserve_kernels import reference

pytestmark = pytest.mark.triton
gemm = pytest.importorskip("slimserve_kernels.fp8_gemm_triton")

FP8 = torch.float8_e4m3fn
# Relative (to max |y|) error: the FP8 weight is exact in fp16/fp32, so only x's rounding
# (fp16) and the fp32 accumulation order differ from the fp32 reference.
REL_TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def _problem(m, n, k, block, dtype, seed=0):
    """Scales span 2**-6..2**2 per block, so a missing or misplaced scale is off by >= 2x."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    shape = (-(-n // block[0]), -(-k // block[1]))
    scale = torch.exp2(torch.randint(-6, 3, shape, generator=gen).float())
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, w, scale, block


def _check(args, config=None):
    out = gemm.fp8_gemm(*args, config=config)
    ref = reference.fp8_gemm(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < REL_TOL[args[0].dtype], err
    return err


@pytest.mark.parametrize("m", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_block_128(m, dtype):
    # N = 200, K = 328: neither a multiple of the 128 block nor of the tiles (partial blocks).
    _check(_problem(m, 200, 328, (128, 128), dtype, seed=m))


@pytest.mark.parametrize("block", [(1, 136), (1, 128), (32, 64)], ids=["channel", "rows", "b32x64"])
def test_other_scale_blocks(block):
    # (1, K): per output channel; (1, 128): per-row block scales of unaligned merged shards.
    _check(_problem(7, 72, 136, block, torch.float32, seed=block[1]))


@pytest.mark.parametrize("split_k", [1, 3])
def test_forced_split_k(split_k):
    cfg = dict(path="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, split_k=split_k)
    _check(_problem(3, 40, 192, (128, 64), torch.float16), cfg)


def test_guard_scale_applied_per_block():
    """Guard: a kernel that reads one scale per row for the whole K (k0 // SBK dropped) fails
    this check. Seen failing: with `s_rows + 0` in the kernel, err ~0.9."""
    x, w, scale, block = _problem(5, 130, 260, (128, 128), torch.float32, seed=3)
    assert scale[:, 0].ne(scale[:, 1]).any()  # the K blocks really differ
    _check((x, w, scale, block))


def test_dequant_path():
    _check(_problem(6, 40, 136, (32, 64), torch.float32), dict(path="dequant", split_k=1))


def test_config_table():
    assert gemm.choose_config(1, 4096, 4096, 128)["split_k"] > 1  # decode fills the GPU
    assert gemm.choose_config(960, 4096, 4096, 128)["split_k"] == 1
    assert gemm.choose_config(4096, 4096, 4096, 128)["path"] == "dequant"
    assert gemm.choose_config(3, 72, 136, 136)["BLOCK_K"] == 64  # per channel: any BK
    assert gemm.choose_config(3, 72, 192, 32)["BLOCK_K"] == 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "block", [(128, 128), (1, 200), (1, 128), (32, 64)], ids=["b128", "channel", "rows", "b32x64"]
)
@pytest.mark.parametrize("bits", [False, True], ids=["fp8", "uint8"])
def test_dequantize_bit_equal_to_reference(dtype, block, bits, monkeypatch):
    """The prefill path's one-pass dequantization (N 130, K 200: partial tiles and scale
    blocks) is bit for bit `reference.dequantize_fp8_blocks`, with the weight as native FP8
    and as the e4m3 bits GPUs below sm_89 get."""
    if bits:
        monkeypatch.setattr(gemm, "_fp8_operand", lambda t: t.view(torch.uint8))
    _, w, scale, _ = _problem(1, 130, 200, block, torch.float32, seed=block[1])
    scale = scale * (1 + torch.rand(scale.shape, generator=torch.Generator().manual_seed(1)))
    # (scales of full fp32 mantissas, as checkpoints have: a product rounded twice differs)
    out = gemm.dequantize_fp8(w, scale, block, dtype)
    ref = reference.dequantize_fp8_blocks(w, scale, block, dtype)
    assert out.dtype == dtype and torch.equal(out, ref)


def test_dequantize_keeps_nan_in_bf16():
    """A NaN scale whose mantissa bits are all set (the NaN a GPU's arithmetic makes) stays NaN
    in bf16: rounding it on integer bits alone carried into the sign bit and gave -0.0. Seen
    failing without the helper's NaN branch."""
    _, w, scale, block = _problem(1, 130, 200, (128, 128), torch.float32)
    scale[0, 1] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    out = gemm.dequantize_fp8(w, scale, block, torch.bfloat16)
    ref = reference.dequantize_fp8_blocks(w, scale, block, torch.bfloat16)
    assert torch.isnan(out[:128, 128:]).all() and torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
