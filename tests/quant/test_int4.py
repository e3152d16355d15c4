"""Packing, RTN error bounds and GPTQ against RTN."""

import pytest
import torch

from app.quant.gptq import HessianAccumulator, quantize_gptq
from app.quant.int4 import Int4Weight, pack_int4, quantization_error, quantize_rtn
from slimserve_kernels.reference import int4_gemm, unpack_int4


def test_pack_unpack_round_trip_and_nibble_order():
    q = torch.randint(0, 16, (5, 24), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.shape == (5, 3) and packed.dtype == torch.int32
    assert torch.equal(unpack_int4(packed).long(), q)
    one = torch.zeros(1, 8, dtype=torch.long)
    one[0, 7] = 0xF  # column 7 -> bits 28..31 of word 0 (the sign bit)
    one[0, 1] = 0x3
    assert int(pack_int4(one)[0, 0]) == int.from_bytes(
        (0xF0000030).to_bytes(4, "little"), "little", signed=True
    )


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_rtn_error_is_at_most_half_a_step(symmetric, group, scale_dtype):
    torch.manual_seed(0)
    w = torch.randn(48, 256) * torch.rand(48, 1) * 3  # rows of different scale
    w[0, :group] = 0.0  # an all-zero group must not divide by zero
    qw = quantize_rtn(w, group, symmetric, scale_dtype=scale_dtype)
    assert qw.scales.dtype == scale_dtype
    err = (qw.dequantize() - w).abs().view(48, -1, group)
    step = qw.scales.float().unsqueeze(-1)
    assert bool((err <= step / 2 + 1e-5).all())
    assert float(err[0, 0].max()) == 0.0
    codes = qw.codes()
    assert int(codes.min()) >= 0 and int(codes.max()) <= 15
    # ... and the relative error is what 4 bits give (~0.1 for gaussian rows)
    assert 0.02 < quantization_error(w, qw) < (0.13 if group == 128 else 0.12)


def test_asymmetric_beats_symmetric_on_shifted_weights():
    torch.manual_seed(0)
    w = torch.rand(32, 128) + 0.5  # all positive: a symmetric grid wastes half its codes
    sym = quantization_error(w, quantize_rtn(w, 32, True))
    asym = quantization_error(w, quantize_rtn(w, 32, False))
    assert asym < 0.6 * sym


def test_reference_gemm_agrees_with_dequantize():
    torch.manual_seed(0)
    w, x = torch.randn(40, 128), torch.randn(3, 128)
    for sym in (True, False):
        qw = quantize_rtn(w, 64, sym)
        y = int4_gemm(x, qw.qweight, qw.scales, qw.zeros, 64)
        torch.testing.assert_close(y, x @ qw.dequantize().T, atol=1e-4, rtol=1e-5)


def test_rtn_rejects_a_group_that_does_not_divide_k():
    with pytest.raises(ValueError, match="not a multiple of group_size=128"):
        quantize_rtn(torch.randn(4, 96), 128)


def correlated_inputs(m: int, k: int, seed: int) -> torch.Tensor:
    """Activations in a fixed 16-dim subspace (as real hidden states are) plus noise."""
    mix = torch.randn(16, k, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 16, generator=g) @ mix + 0.1 * torch.randn(m, k, generator=g)


@pytest.mark.parametrize("symmetric,act_order", [(True, False), (False, False), (True, True)])
def test_gptq_beats_rtn_on_correlated_inputs(symmetric, act_order):
    torch.manual_seed(0)
    w = torch.randn(64, 256)
    x = correlated_inputs(1024, 256, seed=0)
    acc = HessianAccumulator(256)
    for chunk in x.split(300):
        acc.add(chunk)
    torch.testing.assert_close(acc.h, 2 * x.T @ x / len(x), rtol=1e-4, atol=1e-3)
    x_test = correlated_inputs(256, 256, seed=1)  # held out
    gptq = quantize_gptq(w, acc.h, 64, symmetric, act_order)
    rtn = quantize_rtn(w, 64, symmetric)
    e_gptq, e_rtn = quantization_error(w, gptq, x_test), quantization_error(w, rtn, x_test)
    assert e_gptq < 0.5 * e_rtn, (e_gptq, e_rtn)
    assert isinstance(gptq, Int4Weight) and gptq.symmetric == symmetric


def test_gptq_with_identity_hessian_is_rtn():
    # With uncorrelated unit inputs there is nothing to compensate: GPTQ == RTN.
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    g = quantize_gptq(w, torch.eye(64), 32, True, damp=0.0)
    r = quantize_rtn(w, 32, True)
    assert torch.equal(g.qweight, r.qweight) and torch.equal(g.scales, r.scales)
