"""End to end: a tiny random Llama (float32, CPU) run with the Triton attention backend under
the interpreter gives the reference backend's logits and greedy tokens, for BF16-layout
(float32) and FP8 KV caches, through batched prefill, chunked prefill, prefix-cache hits
and batched decode."""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams

pytestmark = pytest.mark.triton
pytest.importorskip("triton")

PROMPTS = [
    [3 + (i * 7) % 300 for i in range(37)],  # longer than one 16-token chunk: chunked
    [5 + (i * 11) % 290 for i in range(9)],
    [3 + (i * 7) % 300 for i in range(21)],  # shares 21 tokens (one full block) with prompt 0
]


def _llm(path: str, backend: str, kv_cache_dtype: str) -> LLM:
    return LLM(
        path,
        dtype="float32",
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
        attention_backend=backend,
        long_prefill_chunk=16,
        max_num_batched_tokens=64,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_triton_backend_matches_reference(llama_path, kv_cache_dtype):
    ref = _llm(llama_path, "reference", kv_cache_dtype)
    tri = _llm(llama_path, "triton", kv_cache_dtype)
    # Logits of one full prefill. Float32 cache: fp32 rounding. FP8: layer 1's fp32-level
    # differences can flip an e4m3 rounding in layer 2's K/V (one e4m3 ulp = 6%), so allow
    # ~1/30 of the FP8-vs-fp32 error itself (~3% of the logits' std, tests/engine/test_fp8_kv).
    want, got = ref.engine.score(PROMPTS[0]), tri.engine.score(PROMPTS[0])
    atol = 1e-4 if kv_cache_dtype == "auto" else 1e-3 * want.std().item()
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    got = [o.token_ids for o in tri.generate(PROMPTS, params)]
    assert got == want and all(len(t) == 8 for t in got)
    # Again after the batch: prompt 2's first block now comes from the prefix cache.
    again = [PROMPTS[2]]
    hits = tri.engine.stats()["prefix_cache_hits"]
    assert tri.generate(again, params)[0].token_ids == ref.generate(again, params)[0].token_ids
    assert tri.engine.stats()["prefix_cache_hits"] > hits
