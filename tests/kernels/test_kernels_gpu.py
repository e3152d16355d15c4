"""Compiled kernels on a real GPU vs the references, at serving shapes and in bf16.

    TRITON_INTERPRET=0 .venv/bin/pytest tests/kernels/test_kernels_gpu.py -q

Skipped without CUDA, and under the interpreter (tests/conftest.py defaults it on).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from kernel_testing import FP8, block_tables, filled_cache

from slimserve_kernels import reference

pytestmark = pytest.mark.gpu  # skipped without CUDA or under the interpreter (conftest)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _mod(name: str):
    return importlib.import_module(f"slimserve_kernels.{name}")


def _cuda(xs):
    return tuple(x.cuda() if isinstance(x, torch.Tensor) else x for x in xs)


@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_gpu(cache_dtype, num_splits):
    gen = torch.Generator().manual_seed(0)
    lens, hq, hkv, d, bs = [1, 700, 5000, 33], 32, 8, 128, 16
    cache = filled_cache(cache_dtype, 400, bs, hkv, d, gen)
    table = block_tables(lens, bs, 400, gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(torch.bfloat16)
    args = _cuda((q, *cache.args(), table, torch.tensor(lens, dtype=torch.int32), d**-0.5))
    out = _mod("paged_decode").paged_decode_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(
        out.float(), reference.paged_decode_attention(*args).float(), **BF16_TOL
    )


@pytest.mark.parametrize("cache_dtype", [FP8, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_gpu(cache_dtype, d):
    gen = torch.Generator().manual_seed(1)
    lens, qlens, hq, hkv, bs = [300, 1000, 77], [300, 129, 1], 16, 4, 16
    cache = filled_cache(cache_dtype, 120, bs, hkv, d, gen)
    table = block_tables(lens, bs, 120, gen)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(qlens), hq, d, generator=gen).to(torch.bfloat16)
    args = _cuda((q, *cache.args(), table, qsl, torch.tensor(lens, dtype=torch.int32), d**-0.5))
    out = _mod("paged_prefill").paged_prefill_attention(*args).float()
    ref = reference.paged_prefill_attention(*args).float()
    # The kernel rounds P to bf16 for the P.V dot (as flash attention does). On an H200,
    # 0-6 of 0.4-1.8M outputs fell outside BF16_TOL (near-zero outputs, absolute errors
    # <= 0.031 < 2 * atol), while outputs of |x| > 8 differ by up to 0.25 inside it (bf16
    # ulps there are 0.06-0.125): at most 1e-5 of the outputs may leave BF16_TOL, none twice it.
    err, tol = (out - ref).abs(), BF16_TOL["atol"] + BF16_TOL["rtol"] * ref.abs()
    assert (err > tol).float().mean().item() <= 1e-5, (err - tol).max()
    assert (err <= 2 * tol).all(), (err - 2 * tol).max()


def test_kv_write_gpu_bits_match_reference():
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(300, 8, 128, generator=gen) * 10
    v = torch.randn(300, 8, 128, generator=gen) * 0.01
    slots = torch.randperm(64 * 16, generator=gen)[:300]
    slots[::7] = -1
    results = []
    for fn in (reference.kv_write, _mod("kv_write_triton").kv_write):
        cache = filled_cache(FP8, 64, 16, 8, 128, torch.Generator().manual_seed(3))
        args = _cuda((k.bfloat16(), v.bfloat16(), *cache.args(), slots))
        fn(*args)
        results.append([t.view(torch.uint8) if t.dtype == FP8 else t for t in args[2:6]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("m", [1, 3, 16, 100, 1024])
@pytest.mark.parametrize("zeros", [False, True])
def test_int4_gemm_gpu(m, zeros):
    gen = torch.Generator().manual_seed(m)
    n, k, g = 4096, 4096, 128
    qw = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.01).to(torch.bfloat16)
    z = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.uint8) if zeros else None
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    args = _cuda((x, qw, s, z, g))
    out = _mod("int4_gemm_triton").int4_gemm(*args).float()
    ref = reference.int4_gemm(*args).float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("m", [1, 7, 64, 300, 1024])
@pytest.mark.parametrize("block", [(128, 128), (1, 4096)])
def test_fp8_gemm_gpu(m, block):
    """Llama-3-8B's down projection shape (K 14336 -> N 4096) on the native e4m3 path (sm_89+)
    or the uint8-bits path, against the fp32 reference."""
    gen = torch.Generator().manual_seed(m)
    n, k = 4096, 14336 if block[1] != 4096 else 4096
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    s = torch.exp2(torch.randint(-14, -9, (-(-n // block[0]), -(-k // block[1])), generator=gen))
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    args = _cuda((x, w, s.float(), block))
    out = _mod("fp8_gemm_triton").fp8_gemm(*args).float()
    ref = reference.fp8_gemm(*args).float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block", [(128, 128), (1, 4096), (1, 128), (32, 64)])
def test_fp8_dequantize_gpu_bits(dtype, block):
    """W8A16's prefill path (M >= 1024) dequantizes in one Triton pass: bit for bit the
    PyTorch reference on the GPU too (one fp32 product, one rounding), native e4m3 or bits."""
    gen = torch.Generator().manual_seed(block[1])
    n, k = 4160, 4096  # N not a multiple of the 64-row tile
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    shape = (-(-n // block[0]), -(-k // block[1]))
    s = torch.exp2(torch.randint(-14, -9, shape, generator=gen))
    s = s * (1 + torch.rand(shape, generator=gen))  # full fp32 mantissas, as checkpoints have
    w, s = _cuda((w, s.float()))
    out = _mod("fp8_gemm_triton").dequantize_fp8(w, s, block, dtype)
    assert torch.equal(out, reference.dequantize_fp8_blocks(w, s, block, dtype))


@pytest.mark.parametrize("m", [1, 64, 300, 4096])
@pytest.mark.parametrize("block", [(128, 128), (1, 4096)])
def test_w8a8_gemm_gpu(m, block):
    """W8A8 at Llama-3-8B's down projection (K 14336 -> N 4096): bf16 activations quantized per
    token group on the GPU, bit for bit as the reference quantizes the same tensor there (both
    divide with IEEE rounding); then the GEMM with real FP8 dots (sm_89+; fp16 dots below)
    against the reference on the same FP8 operands, and W8A8 against W8A16 (the activations'
    e4m3 rounding: rms ~2%, as under the interpreter)."""
    act, w8a8 = _mod("fp8_act_quant_triton"), _mod("fp8_w8a8_triton")
    gen = torch.Generator().manual_seed(m)
    n, k = 4096, 14336 if block[1] != 4096 else 4096
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(FP8)
    s = torch.exp2(torch.randint(-14, -9, (-(-n // block[0]), -(-k // block[1])), generator=gen))
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=gen))
    x, w, s = _cuda((x.to(torch.bfloat16), w, s.float()))
    q, qs = act.quantize_fp8_token_groups(x)
    rq, rqs = reference.quantize_fp8_token_groups(x)
    q_off = (q.view(torch.uint8) != rq.view(torch.uint8)).sum().item()
    assert q_off == 0 and torch.equal(qs, rqs), (q_off, (qs != rqs).sum().item(), qs.numel())
    ref = reference.fp8_block_gemm(q, qs, w, s, block, torch.float32)
    for fp8_dot in (None, False) if m == 300 else (None,):
        out = w8a8.fp8_block_gemm(q, qs, w, s, block, torch.bfloat16, fp8_dot=fp8_dot).float()
        assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-2, fp8_dot
    w8a16 = reference.fp8_gemm(x.float(), w, s, block)
    out = w8a8.fp8_w8a8_gemm(x, w, s, block).float()
    assert ((out - w8a16).norm() / w8a16.norm()).item() < 0.036


@pytest.mark.parametrize("kind", ["dense", "fp8", "int4"])
@pytest.mark.parametrize("t", [1, 9, 80])
def test_fused_moe_gpu(kind, t):
    """GLM-4.5's expert shape (H 5120, I 1536), 16 experts, top-8, bf16; 80 tokens x 8 = 640
    pairs takes the prefill config (BLOCK_M 64). Against the per-expert loop in fp32."""
    from test_triton_fused_moe import routing, weights

    gen = torch.Generator().manual_seed(t)
    extra = {"fp8": dict(block=(128, 128)), "int4": dict(group=32)}.get(kind, {})
    w = weights(kind, 16, 5120, 1536, torch.bfloat16, gen, **extra)
    x = torch.randn(t, 5120, generator=gen).to(torch.bfloat16)
    tw, ids = routing(t, 16, 8, gen)
    for f in ("w13", "w2", "s13", "s2", "z13", "z2"):
        if getattr(w, f) is not None:
            setattr(w, f, getattr(w, f).cuda())
    x, tw, ids = x.cuda(), tw.cuda(), ids.cuda()
    out = _mod("fused_moe_triton").fused_moe(x, tw, ids, w).float()
    ref = reference.fused_moe(x, tw, ids, w).float()
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2
