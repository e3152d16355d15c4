"""Draft-model speculation: exact greedy output on dense and MoE targets, FP8 KV included.

The target drafting for itself must be accepted (almost) always: that checks the draft's
catch-up, positions and recursion end to end (a draft that read the wrong position would
be rejected). Seen failing: starting the recursion one position late (num_tokens + j
instead of num_tokens - 1 + j) dropped the self-draft acceptance rate from 1.0 to ~0.05
while the greedy output stayed equal.
"""

import pytest

from app import LLM, SamplingParams
from tests.models.moe_checkpoints import make_moe_checkpoint

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], list(range(10, 40)), [7, 8, 9, 7, 8, 9, 7, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def draft(path, k=3, **kw):
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": k, "backoff": False}
    return dict(dtype="float32", device="cpu", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def small_draft(checkpoint_factory):
    """Another random Llama with the same tokenizer: one layer, other weights."""
    return checkpoint_factory("llama", num_hidden_layers=1, hidden_size=32, head_dim=8)


@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_self_draft_is_accepted_and_exact(llama_path, kv):
    want = LLM(llama_path, dtype="float32", device="cpu", kv_cache_dtype=kv).generate(
        PROMPTS, GREEDY
    )
    llm = LLM(llama_path, **draft(llama_path, kv_cache_dtype=kv))
    got = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    s = llm.stats()
    assert s["spec_acceptance_rate"] > 0.9, s
    assert s["spec_mean_accepted_length"] > 3.5  # k = 3: ~4 tokens per target forward


def test_small_draft_on_dense_and_moe_targets(llama_path, small_draft, tmp_path):
    moe = make_moe_checkpoint("glm4_moe", str(tmp_path / "glm"))
    for target in (llama_path, moe):
        want = LLM(target, dtype="float32", device="cpu").generate(PROMPTS, GREEDY)
        llm = LLM(target, **draft(small_draft, k=4))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
        assert llm.stats()["spec_proposed_tokens"] > 0


def test_draft_with_another_vocabulary_is_refused(llama_path, checkpoint_factory):
    other = checkpoint_factory("llama", vocab_size=400)
    with pytest.raises(ValueError, match="vocab_size"):
        LLM(llama_path, **draft(other))


def test_mla_draft_gets_its_own_cache_shape(tmp_path):
    """A DeepSeek-V3 (MLA) draft's cache comes from its family's kv_cache_spec hook (one
    latent plane), not the standard K/V planes; drafting for itself it is accepted. Seen
    failing with the hook ignored (standard planes: use_mla False)."""
    path = make_moe_checkpoint("deepseek_v3", str(tmp_path / "ds"))
    want = LLM(path, dtype="float32", device="cpu").generate(PROMPTS, GREEDY)
    llm = LLM(path, **draft(path))
    assert llm.engine.speculator.drafter.runner.cache.spec.use_mla
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in want]
    assert llm.stats()["spec_acceptance_rate"] > 0.9
