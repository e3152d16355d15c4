"""`fp8_activations`: the W8A8 / W8A16 rule, `Fp8Linear`'s dispatch on it (Triton under the
interpreter), and the engine option reaching every FP8 layer while CPU keeps its path."""

import pytest
import torch

import slimserve_kernels
from app import LLM
from app.quant import fp8_activations
from app.quant.fp8 import quantize_fp8_block
from app.quant.fp8_activations import DEQUANT_MIN_M, W8A8_MIN_N, use_w8a8
from app.quant.fp8_linear import Fp8Linear
from slimserve_kernels import reference


def test_rule_auto_needs_fp8_tensor_cores_a_wide_output_and_under_1024_rows(monkeypatch):
    x = lambda m: torch.zeros(m, 8)  # noqa: E731
    assert use_w8a8("w8a8", x(1), 8) and not use_w8a8("w8a16", x(4096), 4096)
    assert not use_w8a8("auto", x(4096), 4096)  # CPU: no FP8 tensor cores
    monkeypatch.setattr(fp8_activations, "fp8_tensor_cores", lambda device: True)
    assert not use_w8a8("auto", x(4096), W8A8_MIN_N - 1)  # a narrow output stays W8A16
    assert use_w8a8("auto", x(1), W8A8_MIN_N)  # decode sizes included
    assert use_w8a8("auto", x(DEQUANT_MIN_M - 1), W8A8_MIN_N)
    assert not use_w8a8("auto", x(DEQUANT_MIN_M), W8A8_MIN_N)  # W8A16's dequant + cuBLAS


def test_rule_threshold_is_the_w8a16_dequant_threshold():
    gemm = pytest.importorskip("slimserve_kernels.fp8_gemm_triton")
    assert DEQUANT_MIN_M == gemm.DEQUANT_MIN_M
    assert gemm.choose_config(DEQUANT_MIN_M, 4096, 4096, 128)["path"] == "dequant"
    assert gemm.choose_config(DEQUANT_MIN_M - 1, 4096, 4096, 128)["path"] == "tiled"


def test_auto_is_the_default():
    from app.config import EngineConfig

    assert EngineConfig(model="m").fp8_activations == "auto"


def _layer(mode: str) -> tuple[Fp8Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    layer = Fp8Linear(256, 72, (128, 128))
    layer.set_weight(*quantize_fp8_block(torch.randn(72, 256, generator=gen), (128, 128)))
    layer.fp8_activations = mode
    return layer, torch.randn(3, 5, 256, generator=gen)


@pytest.mark.triton
def test_fp8_linear_dispatches_w8a8_and_w8a16():
    """Under the interpreter (force_triton): w8a8 equals the W8A8 reference, which differs
    from W8A16 by the activations' FP8 rounding; w8a16 equals the W8A16 reference."""
    pytest.importorskip("triton")
    out = {}
    for mode in ("w8a8", "w8a16"):
        layer, x = _layer(mode)
        with slimserve_kernels.force_triton():
            out[mode] = layer(x).reshape(15, 72)
    args = (x.reshape(15, 256), layer.weight, layer.weight_scale_inv, layer.block)
    w8a8, w8a16 = reference.fp8_w8a8_gemm(*args), reference.fp8_gemm(*args)
    torch.testing.assert_close(out["w8a8"], w8a8, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["w8a16"], w8a16, atol=1e-5, rtol=1e-5)
    assert (w8a8 - w8a16).abs().max() > 1e-3  # the two paths are distinguishable


def test_cpu_keeps_w8a16_and_the_option_reaches_every_fp8_layer(llama_path):
    """CPU: no FP8 activations whatever the option (the same logits for w8a8 and w8a16)."""
    ids = list(range(10, 30))
    logits = {}
    for mode in ("w8a8", "w8a16"):
        kw = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20)
        llm = LLM(llama_path, weight_quant="fp8", fp8_activations=mode, **kw)
        layers = [m for m in llm.engine.model.modules() if isinstance(m, Fp8Linear)]
        assert len(layers) == 8 and {m.fp8_activations for m in layers} == {mode}
        logits[mode] = llm.engine.score(ids)
        llm.shutdown()
    assert torch.equal(logits["w8a8"], logits["w8a16"])
