"""Tenant isolation by cache salt: two salts never share a prefix hit, locally or through the
store's keys; the same salt does hit (so the check can see a hit at all).

Seen failing: with `make_salt` ignoring `cache_salt` (patched to drop it), tenant B's first
request reported A's prompt as cached (num_cached_tokens 32) and the store keys coincided.
"""

import pytest

from app import LLM, SamplingParams
from app.kv.keys import make_salt
from app.serve.replicas.replica import prompt_chunk_keys

PROMPT = list(range(10, 50))  # 40 tokens: two full blocks of 16 can be cached
ONE = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture()
def llm(llama_path):
    return LLM(llama_path, dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 20)


def cached(llm, salt):
    return llm.generate([PROMPT], ONE, cache_salt=salt)[0].num_cached_tokens


def test_two_salts_never_share_a_local_hit(llm):
    assert cached(llm, "tenant-a") == 0
    assert cached(llm, "tenant-b") == 0  # B cannot reuse A's blocks
    assert cached(llm, None) == 0  # nor can a request without a salt
    assert cached(llm, "tenant-a") == 32  # A itself does: the check can see hits


def test_two_salts_never_share_a_store_key(llm):
    engine = llm.engine
    keys = {
        salt: prompt_chunk_keys(PROMPT * 4, engine.salt_base, salt, 16, 32)
        for salt in ("tenant-a", "tenant-b", None, "")
    }
    assert len(keys["tenant-a"]) == 5
    assert not set(keys["tenant-a"]) & set(keys["tenant-b"])
    assert not set(keys["tenant-a"]) & set(keys[None])
    assert keys[None] == keys[""]  # no salt and an empty salt are the same tenant
    # Salt parts are length-prefixed: moving a character across a boundary changes the key.
    assert make_salt("ab", "c", "d", "x") != make_salt("a", "bc", "d", "x")
