"""Prefix cache: hits, tenant isolation, collisions, eviction and leaks."""

from array import array

import pytest
import xxhash

from app import LLM, SamplingParams
from app.engine.request import Request
from app.kv import keys

BASE = [3 + (i * 11) % 300 for i in range(40)]  # 2 full blocks of 16 + 8
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def llm(llama_path):
    return LLM(llama_path, dtype="float32", device="cpu", block_size=16)


def reference(llama_path, prompts):
    plain = LLM(llama_path, dtype="float32", device="cpu", enable_prefix_caching=False)
    return [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_hit_across_requests_gives_same_tokens(llm, llama_path):
    first = llm.generate([BASE], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([BASE + [7, 8, 9]], GREEDY)[0]
    assert second.num_cached_tokens == 32
    assert llm.engine.blocks.stats.hits == 2
    assert [first.token_ids, second.token_ids] == reference(llama_path, [BASE, BASE + [7, 8, 9]])


def test_no_hit_across_cache_salts(llm):
    llm.generate([BASE], GREEDY, cache_salt="tenant-a")
    other = llm.generate([BASE], GREEDY, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0
    same = llm.generate([BASE], GREEDY, cache_salt="tenant-a")[0]
    assert same.num_cached_tokens == 32


def own_tokens_key(parent, ids, salt) -> bytes:
    """A block key that forgets the parent and the salt: equal block tokens always collide."""
    return xxhash.xxh3_128(array("q", ids).tobytes()).digest()


def test_forced_collision_never_serves_wrong_block(llm, llama_path, monkeypatch):
    # Every block gets the same key: only the prefix digests tell blocks apart.
    monkeypatch.setattr(keys, "block_key", lambda parent, ids, salt: b"k" * 16)
    other = [5 + (i * 13) % 290 for i in range(40)]
    outs = llm.generate([BASE], GREEDY) + llm.generate([other], GREEDY)
    assert outs[1].num_cached_tokens == 0
    assert llm.engine.blocks.stats.collisions >= 1
    monkeypatch.undo()
    assert [o.token_ids for o in outs] == reference(llama_path, [BASE, other])


def test_key_collision_after_another_earlier_prefix_is_caught(llm, llama_path, monkeypatch):
    """Block X cached after prefix Z must not serve X after prefix A, even when X's key
    collides (same block tokens, keys forced to forget the parent).

    Seen failing: with the digest comparison in BlockManager.lookup removed (the block's own
    token ids, the old check, are equal), the last prompt took 32 cached tokens, not 16."""
    monkeypatch.setattr(keys, "block_key", own_tokens_key)
    a, z, x = BASE[:16], [7 + (i * 5) % 280 for i in range(16)], BASE[16:32]
    llm.generate([a + [1, 2, 3]], GREEDY)  # caches block A
    llm.generate([z + x + BASE[32:]], GREEDY)  # caches Z, then X computed after Z
    out = llm.generate([a + x + BASE[32:]], GREEDY)[0]
    assert out.num_cached_tokens == 16  # A only
    assert llm.engine.blocks.stats.collisions >= 1
    monkeypatch.undo()
    assert out.token_ids == reference(llama_path, [a + x + BASE[32:]])[0]


def test_key_collision_across_cache_salts_is_caught(llm, monkeypatch):
    """Keys forced to ignore the salt: tenant b still never reuses tenant a's blocks.

    Seen failing: without the digest comparison, tenant b took 32 cached tokens."""
    monkeypatch.setattr(keys, "block_key", own_tokens_key)
    llm.generate([BASE], GREEDY, cache_salt="tenant-a")
    other = llm.generate([BASE], GREEDY, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0
    assert llm.engine.blocks.stats.collisions >= 1


def test_eviction_under_pressure_keeps_outputs_right(llama_path):
    small = LLM(llama_path, dtype="float32", device="cpu", block_size=16)
    small.engine.blocks.__init__(12, 16)  # a 12-block pool: room for ~4 prompts' blocks
    small.engine.scheduler.blocks = small.engine.blocks
    prompts = [[9 + j] + BASE[1:] for j in range(6)]
    outs = [small.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert small.engine.blocks.stats.evictions > 0
    assert outs == reference(llama_path, prompts)
    assert small.engine.blocks.num_free == 12


def test_no_block_leak_after_finish_and_abort(llm):
    engine = llm.engine
    total = engine.blocks.num_blocks
    llm.generate([BASE, BASE[:20]], SamplingParams(max_tokens=5, n=3, seed=1))
    assert engine.blocks.num_free == total
    engine.add_request(Request("a", BASE, SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.add_request(Request("b", BASE[:10], SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    engine.step()
    assert engine.blocks.num_free < total
    engine.abort("a")
    engine.abort("b")
    deltas = engine.step()
    assert {d.finish_reason for d in deltas} == {"abort"}
    assert engine.blocks.num_free == total
    assert not engine.has_unfinished()


def test_n_samples_share_prompt_blocks(llm):
    params = SamplingParams(max_tokens=4, n=4, seed=3, temperature=1.0)
    out = llm.generate([BASE], params)[0]
    assert len(out.outputs) == 4
    # Siblings reuse the first sample's full prompt blocks.
    assert llm.engine.blocks.stats.hits == 3 * 2
