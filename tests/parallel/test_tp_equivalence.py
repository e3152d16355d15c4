"""TP=2/4 (gloo, spawned ranks) gives TP=1's logits within fp32 tolerance and its greedy
tokens, for each dense family and both MoE families, with FP8 KV too; EP=2 gives EP=1's."""

import pytest

from tests.parallel.helpers import compare


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_dense_tp2_matches_tp1(checkpoint_factory, family):
    compare(checkpoint_factory(family), 2)


def test_llama_tp4_replicates_kv_heads_fp8_kv(checkpoint_factory):
    # 4 query heads, 2 KV heads: at TP=4 each KV head lives on 2 ranks.
    compare(checkpoint_factory("llama"), 4, kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_moe_tp2_matches_tp1(moe_factory, family):
    compare(moe_factory(family), 2)


def test_deepseek_tp4_fp8_latent_cache(moe_factory):
    # MLA: 4 heads split 1 per rank, the FP8 latent cache replicated on every rank.
    compare(moe_factory("deepseek_v3"), 4, kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_moe_ep2_matches_ep1(moe_factory, family):
    compare(moe_factory(family), 2, ref_kw={}, enable_expert_parallel=True)


def test_glm4_tp4_ep4_fp8_kv(moe_factory):
    compare(
        moe_factory("glm4_moe"),
        4,
        ref_kw=dict(kv_cache_dtype="fp8_e4m3"),
        kv_cache_dtype="fp8_e4m3",
        enable_expert_parallel=True,
    )
