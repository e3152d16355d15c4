"""The engine's MoE layers through the fused path equal the per-expert module loop, for
dense, FP8-block (weight_quant="fp8") and INT4 (Kimi K2-style g32) experts; GLM-4.5 and
DeepSeek-V3 tiny checkpoints (their transformers equality is in test_glm4_moe/deepseek_v3)."""

import pytest
import torch

import slimserve_kernels
from app import LLM
from app.models.moe import MoE
from models.moe_checkpoints import PROMPTS, int4_experts_checkpoint, make_moe_checkpoint

SCORED = PROMPTS[2]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    glm = make_moe_checkpoint("glm4_moe", str(tmp_path_factory.mktemp("glm")))
    ds = make_moe_checkpoint("deepseek_v3", str(tmp_path_factory.mktemp("ds")))
    return {"glm4_moe": glm, "deepseek_v3": ds}


def _moes(llm) -> list[MoE]:
    return [m for m in llm.engine.model.modules() if isinstance(m, MoE)]


def _score(llm, fused: bool) -> torch.Tensor:
    for m in _moes(llm):
        m.use_fused = fused
    return llm.engine.score(SCORED)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
@pytest.mark.parametrize("weight_quant", [None, "fp8"])
def test_fused_cpu_path_equals_per_expert_loop(paths, family, weight_quant):
    """Guard: seen failing (max diff 1.46) with the local-id shift `ids - local.start`
    replaced by `ids + 1` in MoE.routed."""
    llm = LLM(paths[family], dtype="float32", device="cpu", weight_quant=weight_quant)
    loop = _score(llm, fused=False)
    fused = _score(llm, fused=True)
    kinds = {m.fused_weights().kind for m in _moes(llm)}
    assert kinds == {"fp8" if weight_quant else "dense"}
    torch.testing.assert_close(fused, loop, atol=1e-4, rtol=1e-4)


@pytest.mark.triton
def test_fused_triton_int4_experts_equal_loop(paths, tmp_path):
    """Kimi K2's INT4 release layout (routed experts only, g32 symmetric) through the Triton
    grouped GEMMs (interpreter) vs the Int4Linear module loop (PyTorch int4 matmul)."""
    path = int4_experts_checkpoint(paths["deepseek_v3"], str(tmp_path / "int4"))
    llm = LLM(path, dtype="float32", device="cpu")
    with slimserve_kernels.force_triton():
        x = torch.randn(5, llm.engine.model.config.hidden_size)
        moe = _moes(llm)[0]
        assert moe.fused_weights().kind == "int4"
        weights, ids = moe.gate(x)
        want = moe.routed_loop(x, weights, ids)
        torch.testing.assert_close(moe.routed(x, weights, ids), want, atol=1e-4, rtol=1e-4)
