"""Triton W8A8 FP8 block GEMM and per-token-group activation quantization vs the references
(`reference.quantize_fp8_token_groups`, `fp8_block_gemm`, `fp8_w8a8_gemm`), under the
interpreter: FP8 quantized on the host or by the exact-bits kernel, the dot in fp16 (the
kernel's upcast path) and on FP8 operands (`fp8_dot=True`, which the interpreter runs too)."""

from __future__ import annotations

import pytest
import torch

from slimserve_kernels import reference

pytestmark = pytest.mark.triton
gemm = pytest.importorskip("slimserve_kernels.fp8_w8a8_triton")
act = pytest.importorskip("slimserve_kernels.fp8_act_quant_triton")

FP8 = torch.float8_e4m3fn
# Relative (to max |y|) error vs the reference. Both sides multiply exact e4m3 products and
# sum them in fp32; they differ in where the fp32 scales multiply (per K tile after the dot
# here, per element before it there) and in summation order: fp32 rounding, ~1e-7. An fp16
# output rounds once more (2**-11).
REL_TOL = {torch.float16: 1e-3, torch.float32: 1e-5}


def _activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Rows of magnitude 2**-6..2**2 and one column group 16x larger than the rest, so the
    (row, group) scales differ along both axes: a scale read from the wrong row or group is
    off by >= 2x."""
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 3, (m, 1), generator=gen))
    x[:, 128:256] *= 16
    return x


def _weight(n: int, k: int, block: tuple[int, int], gen: torch.Generator):
    """Block scales 2**-12..2**-7 (outputs stay well inside fp16), a missing one is >= 2x off."""
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    shape = (-(-n // block[0]), -(-k // block[1]))
    return w, torch.exp2(torch.randint(-12, -6, shape, generator=gen).float())


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("m", [1, 3, 130])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_act_quant_bits_match_reference(m, dtype):
    """K = 300: a partial last group of 44 columns. A zero row (m > 1) takes the epsilon
    scale. Seen failing: q computed as x / amax * 448 (one rounding more than x / s) differs
    in some codes."""
    gen = torch.Generator().manual_seed(m)
    x = _activations(m, 300, gen).to(dtype)
    if m > 1:
        x[m // 2] = 0
    q, s = act.quantize_fp8_token_groups(x)
    rq, rs = reference.quantize_fp8_token_groups(x)
    assert s.shape == (m, 3) and q.dtype == FP8
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    assert q.float().abs().eq(448).any()  # each group's amax maps to e4m3's max


@pytest.mark.parametrize("m", [1, 3, 17, 130])
@pytest.mark.parametrize("fp8_dot", [False, True], ids=["fp16-dot", "fp8-dot"])
def test_block_gemm_matches_reference(m, fp8_dot):
    """N = 200, K = 328: neither a multiple of the tiles, the 128 x 128 weight blocks nor the
    128-column activation groups (a partial last group of 72)."""
    gen = torch.Generator().manual_seed(m)
    a, a_s = reference.quantize_fp8_token_groups(_activations(m, 328, gen))
    w, s = _weight(200, 328, (128, 128), gen)
    for out_dtype in (torch.float16, torch.float32):
        out = gemm.fp8_block_gemm(a, a_s, w, s, (128, 128), out_dtype, fp8_dot=fp8_dot)
        ref = reference.fp8_block_gemm(a, a_s, w, s, (128, 128), out_dtype)
        assert _rel_err(out, ref) < REL_TOL[out_dtype]


@pytest.mark.parametrize("block", [(1, 264), (1, 128), (32, 64)], ids=["channel", "rows", "b32x64"])
def test_other_weight_blocks(block):
    gen = torch.Generator().manual_seed(block[1])
    x = _activations(7, 264, gen)
    w, s = _weight(72, 264, block, gen)
    out = gemm.fp8_w8a8_gemm(x, w, s, block)
    assert _rel_err(out, reference.fp8_w8a8_gemm(x, w, s, block)) < REL_TOL[torch.float32]


@pytest.mark.parametrize("split_k", [1, 3])
def test_forced_split_k(split_k):
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, split_k=split_k)
    gen = torch.Generator().manual_seed(split_k)
    x = _activations(5, 400, gen).half()
    w, s = _weight(40, 400, (128, 128), gen)
    out = gemm.fp8_w8a8_gemm(x, w, s, (128, 128), config=cfg)
    assert _rel_err(out, reference.fp8_w8a8_gemm(x, w, s, (128, 128))) < REL_TOL[torch.float16]


def test_swizzled_grid_partial_group():
    """3 x 5 output tiles walked in GROUP_M = 2 rows (the last group has one row), split K."""
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, GROUP_M=2, split_k=2)
    gen = torch.Generator().manual_seed(11)
    x = _activations(37, 384, gen).half()
    w, s = _weight(72, 384, (128, 128), gen)
    out = gemm.fp8_w8a8_gemm(x, w, s, (128, 128), config=cfg)
    assert _rel_err(out, reference.fp8_w8a8_gemm(x, w, s, (128, 128))) < REL_TOL[torch.float16]


def test_tuned_table_wins_for_its_gpu(tmp_path, monkeypatch):
    from slimserve_kernels import tuned

    mine = dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=4, num_warps=8, num_stages=4,
                split_k=1)  # fmt: skip
    key = ",".join(map(str, gemm.table_key(600, 4096, 7168)))
    assert key == "1024,4096,7168"
    tuned.write_table(gemm.TABLE, "Test GPU", ["m_bucket", "n", "k"], {key: mine}, "test",
                      root=tmp_path)  # fmt: skip
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tuned.table.cache_clear()
    try:
        assert gemm.choose_config(600, 4096, 7168, 128, device="Test GPU") == mine
        assert gemm.choose_config(600, 4096, 7168, 128)["BLOCK_N"] == 128  # the rule
        assert gemm.choose_config(600, 4096, 7168, 64, device="Test GPU")["BLOCK_K"] == 64
    finally:
        tuned.table.cache_clear()


def test_guard_activation_scale_per_group():
    """Guard: the activation scale must be read per (row, K group). Seen failing: with
    `k0 // SBK` in place of `k0 // GROUP` in the kernel (weight blocks of 64 columns, so the
    index runs past the 128-column groups), err ~1.7; with `as_rows + 0` (group 0's scale for
    the whole row), err ~0.95."""
    gen = torch.Generator().manual_seed(11)
    x = _activations(9, 384, gen)
    w, s = _weight(48, 384, (32, 64), gen)
    _, a_s = reference.quantize_fp8_token_groups(x)
    assert a_s[:, 0].ne(a_s[:, 1]).all()  # the groups really differ
    out = gemm.fp8_w8a8_gemm(x, w, s, (32, 64))
    assert _rel_err(out, reference.fp8_w8a8_gemm(x, w, s, (32, 64))) < REL_TOL[torch.float32]


def test_w8a8_error_within_fp8_activation_rounding():
    """Against the unquantized product x @ W.T (W's own FP8 value, so only the activations'
    quantization counts): each activation rounds to e4m3 with relative error <= 2**-4 (3
    mantissa bits) or, below e4m3's normal range (|x / s| < 2**-6), absolute error <= 2**-10
    s. So |y - y_exact| <= sum_k (2**-4 |x_k| + 2**-10 s_k) |W_k| per output, plus fp32
    rounding. Typically (rms) it is a rounding error spread over half an ulp: below
    2**-4 / sqrt(3) ~ 0.036 of the output."""
    gen = torch.Generator().manual_seed(5)
    x = _activations(17, 520, gen)
    w, s = _weight(96, 520, (128, 128), gen)
    wd = reference.dequantize_fp8_blocks(w, s, (128, 128))  # [N, K] fp32
    exact = x.double() @ wd.double().T
    out = gemm.fp8_w8a8_gemm(x, w, s, (128, 128)).double()
    _, a_s = reference.quantize_fp8_token_groups(x)
    s_cols = a_s.repeat_interleave(128, dim=1)[:, :520].double()  # [M, K] each column's scale
    bound = (2**-4 * x.double().abs() + 2**-10 * s_cols) @ wd.double().abs().T
    slack = 1e-6 * (x.double().abs() @ wd.double().abs().T)
    assert ((out - exact).abs() <= bound + slack).all()
    rms = ((out - exact).norm() / exact.norm()).item()
    assert 1e-3 < rms < 0.036, rms  # quantized (not exact), and as fine as e4m3 rounding


def test_no_rows():
    w, s = _weight(40, 256, (128, 128), torch.Generator().manual_seed(0))
    out = gemm.fp8_w8a8_gemm(torch.zeros(0, 256), w, s, (128, 128))
    assert out.shape == (0, 40) and out.dtype == torch.float32


def test_config_table():
    assert gemm.choose_config(1, 4096, 4096, 128)["split_k"] > 1  # decode fills the GPU
    big = gemm.choose_config(4096, 4096, 4096, 128)
    assert big["split_k"] == 1 and big["BLOCK_M"] == 128 and big["BLOCK_K"] == 128
    assert gemm.choose_config(3, 72, 136, 136)["BLOCK_K"] == 128  # per channel
    assert gemm.choose_config(3, 72, 192, 64)["BLOCK_K"] == 64
    with pytest.raises(AssertionError, match="multiple of 32"):
        gemm.choose_config(3, 72, 192, 48)
