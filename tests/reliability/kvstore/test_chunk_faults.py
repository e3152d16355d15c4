"""Chunk faults between the store and an engine: each is caught before the KV is used,
counted by the store, and recomputed, so the output equals an undisturbed run.

No Serve: a producer Engine exports a prompt's chunks (prefill_only), `publish` hands them
to a real store shard (a Ray actor), the fault is applied to what the shard returns for
chunk 1 of 3 (tests/reliability/kvstore/faults.py), and a reader Engine imports what
`fetch_verified` verified, as a PrefillServer does on a store hit, then generates. The
reference is a third engine that never saw the store.
"""

import asyncio

import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.engine import Engine
from app.engine.request import Request
from app.engine.sampling_params import SamplingParams
from app.kvstore.store import KVStoreClient
from app.kvstore.transfer import fetch_verified, publish
from reliability.kvstore.faults import FAULTS, FaultyShardActor, apply_fault

pytestmark = pytest.mark.ray

CHUNK = 32  # tokens per chunk; 2 blocks of 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# Which store counter each fault must raise (the reason fetch_verified drops the chunk with).
COUNTER = {"lost": "chunk_fetch_failures"}


def make_engine(path) -> Engine:
    cache = CacheConfig(
        block_size=16, kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=2 << 20, chunk_tokens=CHUNK
    )
    return Engine(EngineConfig(model=path, dtype="float32", device="cpu", cache=cache))


def run(engine: Engine, request: Request):
    engine.add_request(request)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


@pytest.fixture(scope="module")
def engines(llama_path):
    """producer, reader, reference: each with its own (empty) prefix cache."""
    return [make_engine(llama_path) for _ in range(3)]


@pytest.fixture
def shard(ray_session):
    shard = FaultyShardActor.remote(4 << 20, 0)
    yield shard
    ray_session.kill(shard)


def prompt_pair(seed: int) -> tuple[list[int], list[int]]:
    """A 100-token prompt (3 full chunks + 4 tokens) and one with another first chunk: its
    chunk 1 has the same tokens at the same position, but other KV and another key."""
    p = [3 + (seed * 31 + i * 7) % 290 for i in range(100)]
    return p, [5 + (seed + i * 3) % 280 for i in range(CHUNK)] + p[CHUNK:]


def published(producer: Engine, store: KVStoreClient, prompt: list[int]):
    _, done = run(producer, Request(f"p{id(prompt)}", prompt, GREEDY, prefill_only=True))
    full = [c for c in done.exported_chunks if c.meta.num_tokens == CHUNK]
    return asyncio.run(publish(store, full))


def read(reader: Engine, store: KVStoreClient, stored, prompt: list[int]):
    """A store hit as a replica takes it: look up, fetch and verify, import, generate."""
    expect = reader.chunk_format
    hit = asyncio.run(store.match_prefix([s.key for s in stored]))
    got = asyncio.run(fetch_verified(store, hit, expect, prompt, timeout_s=20))
    out = run(reader, Request(f"r{id(prompt)}", prompt, GREEDY, kv_import=got.chunks or None))
    return got, out


def test_undisturbed_chunks_are_all_used(engines, shard):
    """The control: with nothing wrong, the reader takes all 96 stored tokens."""
    producer, reader, reference = engines
    store = KVStoreClient([shard])
    prompt, _ = prompt_pair(0)
    stored = published(producer, store, prompt)
    got, out = read(reader, store, stored, prompt)
    assert not got.failures and got.num_tokens == 3 * CHUNK
    assert out[0].num_cached_tokens == 3 * CHUNK
    assert tokens(out) == tokens(run(reference, Request("ref0", prompt, GREEDY)))


@pytest.mark.parametrize("fault", FAULTS)
def test_chunk_fault_is_caught_counted_and_recomputed(engines, shard, fault):
    """Chunk 1 is damaged in the store: the reader keeps chunk 0 only, the shard drops
    chunk 1 and counts it, the engine recomputes from token 32, and the tokens equal the
    reference's.

    Seen failing (each check broken once, by hand): flip and swap with the tag comparison in
    KVChunk.decode skipped (fetch_verified accepted the damaged chunk); truncate only with
    both the payload-length check in chunk_header.parse and the tag comparison skipped
    (either alone catches it; then the import raised on the short payload); lost with
    fetch_verified letting fetch errors propagate (OwnerDiedError escaped instead of a
    recompute); other_key with fetch_verified not passing `expected_key` (accepted, not
    counted; the engine's own key check in kv_transfer still refused it, with that removed
    its prefix digest did, and with all three removed the reader used 96 foreign tokens and
    its output differed from the reference's)."""
    producer, reader, reference = engines
    store = KVStoreClient([shard])
    prompt, other_prompt = prompt_pair(1 + FAULTS.index(fault))
    stored = published(producer, store, prompt)
    other = published(producer, store, other_prompt)[1] if fault == "other_key" else stored[2]
    apply_fault(shard, fault, stored[1], other)

    got, out = read(reader, store, stored, prompt)
    assert [c.key for c in got.chunks] == [stored[0].key]  # nothing from chunk 1 on
    reason = "fetch" if fault == "lost" else "integrity"
    assert [(k, r) for k, r, _ in got.failures] == [(stored[1].key, reason)]
    stats = asyncio.run(store.stats())
    assert stats[COUNTER.get(fault, "integrity_failures")] == 1 and stats["drops"] == 1
    assert asyncio.run(store.lookup_prefix([s.key for s in stored])) == 1  # chunk 1 is gone
    assert out[0].num_cached_tokens == CHUNK
    assert tokens(out) == tokens(run(reference, Request(f"ref{fault}", prompt, GREEDY)))
