"""Int4Linear on CPU (PyTorch's int4pack kernels) against dequantize-then-matmul."""

import pytest
import torch

from app.models.layers import MergedColumnParallelLinear, RowParallelLinear
from app.quant.apply import quantize_model
from app.quant.int4 import quantize_rtn
from app.quant.int4_linear import CpuInt4Pack, Int4Linear, regroup

TOL = {torch.float32: (2e-4, 1e-4), torch.bfloat16: (0.15, 0.02), torch.float16: (2e-2, 5e-3)}


def test_cpu_int4pack_convention():
    # Pins what the docstring of int4_linear.py states: W = (q - 8) * scale + offset.
    torch.manual_seed(0)
    n, k, g = 16, 64, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    s, off = torch.rand(k // g, n) + 0.5, torch.randn(k // g, n)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(3, k)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, g, torch.stack([s, off], -1))
    w = (q - 8) * s.T.repeat_interleave(g, 1) + off.T.repeat_interleave(g, 1)
    torch.testing.assert_close(y, x @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "n,k,group,symmetric,dtype",
    [
        (20, 96, 32, True, torch.float32),  # N not a multiple of 16: padded rows
        (64, 256, 128, False, torch.bfloat16),
        (48, 128, 64, False, torch.float16),
        (32, 1024, 512, True, torch.float32),  # group > 256: split into 256s
        (16, 64, 16, False, torch.float32),  # no CPU kernel for 16: cached dense
    ],
)
def test_int4_linear_matches_dequantized_matmul(n, k, group, symmetric, dtype):
    torch.manual_seed(0)
    qw = quantize_rtn(torch.randn(n, k), group, symmetric, scale_dtype=dtype)
    bias = torch.randn(n).to(dtype)
    lin = Int4Linear(k, n, group, symmetric, bias=True, params_dtype=dtype)
    lin.set_weight(qw, bias)
    x = torch.randn(2, 3, k).to(dtype)
    y = lin(x)
    assert y.shape == (2, 3, n) and y.dtype == dtype
    ref = x.float() @ qw.dequantize().T + bias.float()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), ref, atol=atol * ref.abs().max().item() / 10, rtol=rtol)
    if group in (32, 64, 128, 256, 512):  # the fast path really is PyTorch's int4 kernel
        assert lin._cpu[dtype].dense is None and lin._cpu[dtype].packed.dtype == torch.uint8


def test_act_order_permutation_is_applied_to_inputs():
    torch.manual_seed(0)
    n, k = 16, 64
    w = torch.randn(n, k)
    perm = torch.randperm(k)
    qw = quantize_rtn(w[:, perm], 32, True)  # groups contiguous in permuted order
    lin = Int4Linear(k, n, 32, True, act_order=True, params_dtype=torch.float32)
    lin.set_weight(qw)
    lin.perm.data.copy_(perm)
    x = torch.randn(5, k)
    torch.testing.assert_close(lin(x), x @ lin.dequantized_weight().T, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lin.dequantized_weight()[:, perm], qw.dequantize())


def test_regroup_is_exact():
    torch.manual_seed(0)
    qw = quantize_rtn(torch.randn(8, 512), 256, False)
    small = regroup(qw, (128, 64, 32))
    assert small.group_size == 128 and small.scales.shape == (8, 4)
    assert torch.equal(small.dequantize(), qw.dequantize())


@pytest.mark.triton
def test_cuda_path_arguments_run_the_triton_kernel():
    # What Int4Linear hands slimserve_kernels.int4_gemm on CUDA, run by the Triton interpreter here.
    import slimserve_kernels

    torch.manual_seed(0)
    qw = regroup(quantize_rtn(torch.randn(32, 256), 256, False), (128, 64, 32))
    x = torch.randn(4, 256)
    y = slimserve_kernels.triton_int4_gemm(x, qw.qweight, qw.scales, qw.zeros, qw.group_size)
    torch.testing.assert_close(y, x @ qw.dequantize().T, atol=1e-3, rtol=1e-4)


@pytest.mark.triton
@pytest.mark.parametrize("symmetric", [True, False])
def test_kernel_weight_is_a_view_and_runs_the_kn_kernel(symmetric):
    # The K-major weight Int4Linear hands slimserve_kernels.int4_gemm_kn on CUDA, run by the
    # Triton interpreter here: views of the (now column-major) parameters, the same values.
    import slimserve_kernels

    torch.manual_seed(0)
    lin = Int4Linear(128, 24, 64, symmetric, params_dtype=torch.float32)
    lin.set_weight(quantize_rtn(torch.randn(24, 128), 64, symmetric))
    x = torch.randn(3, 128)
    before = lin(x)  # the CPU path, canonical row-major parameters
    w = lin.kernel_weight()
    assert w.qweight_t.data_ptr() == lin.qweight.data_ptr() and lin.kernel_weight() is w
    assert w.scales_t.data_ptr() == lin.scales.data_ptr()
    y = slimserve_kernels.triton_int4_gemm_kn(x, w)
    torch.testing.assert_close(y, x @ lin.dequantized_weight().T, atol=1e-4, rtol=1e-4)
    lin._cpu = {}
    torch.testing.assert_close(lin(x), before)  # the CPU pack from column-major parameters
    lin.set_weight(quantize_rtn(torch.randn(24, 128), 64, symmetric))
    assert "kn" not in lin._gpu  # new weights: the layout is made again


def test_quantize_model_replaces_linears_and_keeps_tp_roles():
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.up = MergedColumnParallelLinear(64, [32, 32])
    model.down = RowParallelLinear(64, 64, bias=True)
    for p in model.parameters():
        p.data.normal_()
    x = torch.randn(3, 64)
    dense = [model.up.weight.data.clone(), model.down.weight.data.clone(), model.down.bias.clone()]
    done = quantize_model(model, group_size=32, symmetric=False)
    assert done == {"up": 32, "down": 32}
    assert isinstance(model.up, Int4Linear) and model.down.reduce_output
    ref = x @ dense[1].T + dense[2]
    y = model.down(x)
    assert float((y - ref).norm() / ref.norm()) < 0.15
    torch.testing.assert_close(
        y, x @ model.down.dequantized_weight().T + dense[2], atol=1e-4, rtol=1e-4
    )


def test_cpu_pack_is_built_once_and_rebuilt_after_new_weights():
    lin = Int4Linear(64, 16, 32, True, params_dtype=torch.float32)
    lin.set_weight(quantize_rtn(torch.randn(16, 64), 32, True))
    x = torch.randn(2, 64)
    lin(x)
    pack = lin._cpu[torch.float32]
    lin(x)
    assert lin._cpu[torch.float32] is pack and isinstance(pack, CpuInt4Pack)
    w2 = torch.randn(16, 64)
    lin.set_weight(quantize_rtn(w2, 32, True))
    torch.testing.assert_close(lin(x), x @ lin.dequantized_weight().T, atol=1e-4, rtol=1e-4)
