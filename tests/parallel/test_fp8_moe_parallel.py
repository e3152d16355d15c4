"""FP8-block MoE checkpoints (weights kept FP8, experts through the fused MoE path) under
tensor and expert parallelism give TP=1's logits and tokens."""

import pytest
import torch

from app.quant.load import load_model
from tests.parallel.helpers import compare, make_llm
from tests.quant.builders import make_fp8_block


@pytest.fixture(scope="module")
def fp8_glm(moe_factory, tmp_path_factory):
    # 16 x 16 blocks: TP=2 splits each expert's 32 intermediate rows into 16 per rank, so the
    # blocks stay whole on every rank (32 x 32 blocks would straddle the slices).
    root = tmp_path_factory.mktemp("fp8_glm")
    path, _ = make_fp8_block(moe_factory("glm4_moe"), str(root / "q"), str(root / "t"), (16, 16))
    return path


def test_fp8_experts_run_fused_and_stay_fp8(fp8_glm):
    model, _ = load_model(fp8_glm, torch.float32, "cpu")
    moe = [m for m in model.modules() if hasattr(m, "fused_weights")]
    assert moe and all(m.fused_weights().kind == "fp8" for m in moe)
    assert all(m.fused_weights().w13.dtype == torch.float8_e4m3fn for m in moe)


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_fp8_moe_parallel_matches_single_rank(fp8_glm, ep):
    """Seen to fail: with the fused path given global instead of rank-local expert ids
    (`ids - self.local.start` dropped in MoE.routed) EP=2 logits differ by 0.72."""
    kw = dict(enable_expert_parallel=True) if ep else {}
    compare(fp8_glm, 2, ref_kw={}, **kw)


def test_fp8_moe_single_rank_is_not_the_dense_model(fp8_glm, moe_factory):
    """The comparison above is not vacuous: FP8 logits differ from the BF16 source's."""
    fp8 = make_llm(fp8_glm).engine.score(list(range(10, 30)))
    dense = make_llm(moe_factory("glm4_moe")).engine.score(list(range(10, 30)))
    assert (fp8 - dense).abs().max() > 1e-3
