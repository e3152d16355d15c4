"""The C++ CPU fused ops (slimserve_kernels/cpu_fused.py) against the torch expressions they
replace, bit for bit: F.rms_norm, add then F.rms_norm, F.silu(gate) * up, and
RotaryEmbedding.rotate's torch path. Then the models: logits with the kernels on equal those
with them off (SLIMSERVE_CPU_KERNELS=0), and a failed build falls back to torch.

Equality is exact (torch.equal), not a tolerance: the kernels round every product and sum on
its own and sum a row in ATen's order (slimserve_kernels/README.md)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from app import LLM
from app.models.glm4_moe import PartialRotaryEmbedding
from app.models.layers import RMSNorm
from app.models.rotary import RotaryEmbedding
from models.moe_checkpoints import make_moe_checkpoint
from slimserve_kernels import cpu_build, cpu_fused
from tiny_models import FAMILIES


@pytest.fixture(scope="module")
def kernel():
    if not cpu_fused.available():
        pytest.skip("the C++ CPU kernels did not build here (the fallback tests still run)")


def rows(t: int, h: int, seed: int, pad: int = 0) -> torch.Tensor:
    """[t, h] with per-row magnitudes over 2**-6..2**6; pad > 0: a view of a [t, h + pad]
    tensor (row stride h + pad), as a slice of a projection's output."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h + pad, generator=g)
    x *= torch.exp2(torch.randint(-6, 7, (t, 1), generator=g).float())
    return x[:, :h]


# H: below one vector (scalar sum), not a multiple of 8 / 16, the default model's 256, sizes
# where ATen's cascade starts a second level (>= 512 floats), real models' 3584 / 4096.
HIDDEN = [5, 17, 100, 256, 1000, 3584, 4096]


@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("t", [1, 7, 33])
def test_rms_norm_is_f_rms_norm_bit_for_bit(kernel, h, t):
    x, w = rows(t, h, seed=h + t, pad=3), torch.randn(h)
    assert x.stride(0) == h + 3  # rows of a wider tensor
    assert torch.equal(cpu_fused.rms_norm(x, w, 1e-6), F.rms_norm(x, (h,), w, 1e-6))
    norm = RMSNorm(h, 1e-5)
    norm.weight.data.copy_(w)
    assert torch.equal(norm(x), F.rms_norm(x, (h,), w, 1e-5))


def test_rms_norm_of_heads_viewed_in_a_projection(kernel):
    """q/k norm (Qwen3): [T, H, D] heads inside the qkv output, strides (row, D, 1)."""
    t, hq, hkv, d = 7, 5, 3, 64
    qkv = rows(t, (hq + 2 * hkv) * d, seed=1)
    q = qkv[:, : hq * d].view(t, hq, d)
    w = torch.randn(d)
    assert torch.equal(cpu_fused.rms_norm(q, w, 1e-6), F.rms_norm(q, (d,), w, 1e-6))


@pytest.mark.parametrize("h", HIDDEN)
def test_add_rms_norm_adds_in_place_then_norms(kernel, h):
    t = 9
    x, residual, w = rows(t, h, seed=h, pad=5), rows(t, h, seed=h + 1).clone(), torch.randn(h)
    total = residual + x
    out = cpu_fused.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, total)
    assert torch.equal(out, F.rms_norm(total, (h,), w, 1e-6))


def test_norm_module_add_norm_on_and_off(kernel, monkeypatch):
    h, eps = 100, 1e-6
    norm = RMSNorm(h, eps)
    norm.weight.data.normal_()
    x, residual = rows(5, h, seed=3), rows(5, h, seed=4)
    outs = []
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_build.ENV, switch)
        r = residual.clone()
        out, same = norm.add_norm(x, r)
        assert same is r and torch.equal(r, residual + x)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("i", [1, 7, 33, 100, 768, 1000])
@pytest.mark.parametrize("t", [1, 5])
def test_silu_and_mul_is_the_torch_expression(kernel, i, t):
    """I around torch's vector blocks (32 floats under AVX512): the scalar tail too."""
    gate_up = rows(t, 2 * i, seed=i, pad=2)  # a view, row stride 2I + 2
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(cpu_fused.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 7, 33])
def test_rotary_in_place_is_the_torch_rotation(kernel, d, t):
    """q and k side by side inside the qkv output (H = 5 + 3), shuffled positions."""
    hq, hkv, max_pos = 5, 3, 4096
    rope = RotaryEmbedding(d, max_pos, 500000.0)
    qkv = rows(t, (hq + 2 * hkv) * d, seed=d + t).clone()
    before = qkv.clone()
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
    positions = torch.randperm(max_pos, generator=torch.Generator().manual_seed(t))[:t]
    expected = rope.rotate(positions, qk)  # torch path (inplace False)
    assert rope.rotate(positions, qk, inplace=True) is qk
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (hq + hkv) * d :], before[:, (hq + hkv) * d :])  # v untouched


def test_partial_rotary_in_place_leaves_the_rest(kernel):
    """GLM-4.5: RoPE on the first half of each head only; in place or into a new tensor."""
    t, h, d = 7, 3, 64
    rope = PartialRotaryEmbedding(d, 0.5, 256, 10000.0)
    x = rows(t, h * d, seed=9).clone().view(t, h, d)
    positions = torch.randperm(256)[:t]
    expected = rope.rotate(positions, x)
    assert rope.rotate(positions, x, inplace=True) is x
    assert torch.equal(x, expected)


def test_rotary_position_outside_the_table_is_an_error(kernel):
    rope = RotaryEmbedding(64, 16, 10000.0)
    with pytest.raises(RuntimeError, match="outside the table"):
        rope.rotate(torch.tensor([3, 16]), torch.randn(2, 2, 64), inplace=True)


def test_other_dtypes_keep_the_torch_path(kernel):
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert not cpu_fused.takes(x)
    rope = RotaryEmbedding(16, 8, 10000.0)
    q = torch.randn(2, 2, 16, dtype=torch.bfloat16)
    out = rope.rotate(torch.tensor([1, 2]), q, inplace=True)
    assert out is not q and out.dtype == torch.bfloat16


def spy_calls(monkeypatch) -> dict[str, int]:
    """Counts the calls of each fused op from now on."""
    calls = {}

    def spy(name: str):
        fn, calls[name] = getattr(cpu_fused, name), 0

        def counted(*a):
            calls[name] += 1
            return fn(*a)

        monkeypatch.setattr(cpu_fused, name, counted)

    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_"):
        spy(name)
    return calls


def checkpoint(family: str, checkpoint_factory, tmp_path) -> str:
    if family in FAMILIES:
        return checkpoint_factory(family)
    return make_moe_checkpoint(family, str(tmp_path))


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm4_moe", "deepseek_v3"])
def test_model_logits_equal_with_kernels_off(
    kernel, checkpoint_factory, tmp_path, monkeypatch, family
):
    """Every prompt position's logits of a tiny checkpoint (Llama with llama3 RoPE scaling,
    Qwen3's q/k norms, GLM-4.5's partial RoPE and MoE layers, DeepSeek-V3's MLA): the same
    bits with the fused ops on and off."""
    path = checkpoint(family, checkpoint_factory, tmp_path)
    ids = [7] + [i % 300 + 3 for i in range(40)]
    calls = spy_calls(monkeypatch)
    scores = [LLM(path, dtype="float32", device="cpu").engine.score(ids)]
    assert calls["rms_norm"] and calls["add_rms_norm"]  # the kernels ran
    assert calls["rotary_"] or family == "deepseek_v3"  # MLA keeps its interleaved torch RoPE
    # Only these ops off: SLIMSERVE_CPU_KERNELS=0 would switch the C++ attention off too,
    # whose sums run in another order than the torch reference's.
    monkeypatch.setattr(cpu_fused, "available", lambda: False)
    scores.append(LLM(path, dtype="float32", device="cpu").engine.score(ids))
    assert torch.equal(scores[0], scores[1])


def test_failed_build_falls_back_to_torch(monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_build, "build", broken)
    cpu_fused.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_fused.__name__):
            assert not cpu_fused.available()
        assert "build failed" in caplog.text
        x = torch.randn(3, 40)
        norm = RMSNorm(40, 1e-6)
        norm.weight.data.normal_()
        assert torch.equal(norm(x), F.rms_norm(x, (40,), norm.weight, 1e-6))
    finally:
        cpu_fused.load.cache_clear()  # the next caller loads the real build again


def test_off_switch_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv(cpu_build.ENV, "0")

    def must_not_load():
        raise AssertionError("the kernel was used although SLIMSERVE_CPU_KERNELS=0")

    monkeypatch.setattr(cpu_fused, "load", must_not_load)
    assert not cpu_fused.takes(torch.randn(2, 8))
    x = torch.randn(4, 24)
    norm = RMSNorm(24, 1e-6)
    # its weight is allocated, not initialised (a checkpoint fills it), as in the tests
    # above: left so, it may hold a NaN, and NaN != NaN (seen: a CI run failed on it)
    norm.weight.data.normal_()
    assert torch.equal(norm(x), F.rms_norm(x, (24,), norm.weight, 1e-6))
