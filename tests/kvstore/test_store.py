import asyncio
import dataclasses
import time

import numpy as np
import pytest
import ray
import torch
from polling import eventually

from app.kv.chunk import ChunkMeta, KVChunk
from app.kv.chunk_format import ChunkFormat
from app.kv.layout import KVCacheSpec
from app.kvstore.store import KVStoreClient, create_store
from app.kvstore.transfer import fetch_verified, publish

pytestmark = pytest.mark.ray

EXPECT = ChunkFormat("tiny@1", KVCacheSpec(2, 2, 8, 4, "fp8_e4m3"), chunk_tokens=8)
LAYOUT = EXPECT.layout
PROMPT = list(range(1000, 1024))


def make_chunks(prompt=PROMPT, chunk_tokens=8) -> list[KVChunk]:
    """Consecutive FP8 chunks of ``prompt`` with chained stand-in keys."""
    chunks, parent = [], None
    for start in range(0, len(prompt), chunk_tokens):
        ids = tuple(prompt[start : start + chunk_tokens])
        key = bytes([start % 251]) * 8 + bytes(str(ids), "ascii")[:8]
        meta = ChunkMeta("tiny@1", "fp8_e4m3", LAYOUT, ids, start, key, parent)
        g = torch.Generator().manual_seed(start)
        kv = torch.randn(2, 2, len(ids), 2, 8, generator=g).to(torch.float8_e4m3fn)
        scales = torch.full((2, 2, len(ids), 2), -3, dtype=torch.int8)
        chunks.append(KVChunk.from_tensors(meta, kv, scales))
        parent = key
    return chunks


@pytest.fixture
def client(ray_session):
    shards = create_store(capacity_bytes=1 << 20, num_shards=2)
    yield KVStoreClient(shards)
    for s in shards:
        ray.kill(s)


def run(coro):
    return asyncio.run(coro)


def test_publish_then_match_prefix_round_trips(client):
    chunks = make_chunks()
    run(publish(client, chunks))
    keys = [c.key for c in chunks]
    run_ = run(client.match_prefix(keys + [b"missing-key-0000"]))
    assert [s.key for s in run_] == keys
    got = run(fetch_verified(client, run_, EXPECT, PROMPT))
    assert not got.failures and got.num_tokens == len(PROMPT)
    for a, b in zip(got.chunks, chunks):
        assert torch.equal(a.to_tensors()[0].view(torch.uint8), b.to_tensors()[0].view(torch.uint8))
    stats = run(client.stats())
    assert stats["shards"] == 2 and stats["chunks"] == 3
    assert stats["bytes"] == sum(s.size for s in run_)

    # Counting is fire-and-forget (and the shard is multi-threaded): wait for it to land.
    def counted() -> bool:
        stats = run(client.stats())
        return (stats["hits"], stats["misses"]) == (3, 1)

    assert eventually(counted)


def test_prefix_run_stops_at_the_first_gap(client):
    chunks = make_chunks()
    run(publish(client, [chunks[0], chunks[2]]))
    keys = [c.key for c in chunks]
    assert run(client.lookup_prefix(keys)) == 1
    assert [s.key for s in run(client.match_prefix(keys))] == [chunks[0].key]
    assert run(client.lookup_prefix(keys[1:])) == 0


def test_lru_evicts_least_recently_used_under_byte_budget(ray_session):
    chunks = make_chunks(list(range(40)), chunk_tokens=8)  # 5 chunks
    size = put_chunk_size(chunks[0])
    client = KVStoreClient(create_store(capacity_bytes=3 * size + size // 2, num_shards=1))
    for chunk in chunks[:3]:  # one at a time: the shard serves calls concurrently
        run(publish(client, [chunk]))
    run(client.match_prefix([chunks[0].key]))  # chunk 0 is now the most recently used
    assert eventually(lambda: run(client.stats())["hits"] == 1)
    run(publish(client, chunks[3:4]))  # evicts chunk 1, the least recently used
    present = ray.get(client.shards[0].keys.remote())
    assert set(present) == {chunks[0].key, chunks[2].key, chunks[3].key}
    stats = run(client.stats())
    assert stats["evictions"] == 1 and stats["bytes"] <= stats["capacity_bytes"]
    ray.kill(client.shards[0])


def put_chunk_size(chunk: KVChunk) -> int:
    return len(chunk.encode())


def test_corrupted_stored_chunk_is_dropped_and_counted(client):
    chunks = make_chunks()
    stored = run(publish(client, chunks))
    victim = stored[1]
    data = np.array(ray.get(victim.ref))  # a writable copy
    data[-5] ^= 0xFF
    run(client.drop(victim.key, "test-replace"))
    run(client.put(victim.key, data, victim.tag, list(victim.token_ids)))

    got = run(
        fetch_verified(client, run(client.match_prefix([c.key for c in chunks])), EXPECT, PROMPT)
    )
    assert len(got.chunks) == 1 and got.num_tokens == 8  # the run before the bad chunk
    assert [(k, r) for k, r, _ in got.failures] == [(victim.key, "integrity")]
    assert "tag mismatch" in got.failures[0][2]
    stats = run(client.stats())
    assert stats["integrity_failures"] == 1 and stats["chunks"] == 2
    assert run(client.lookup_prefix([c.key for c in chunks])) == 1


def test_chunk_for_another_prompt_is_rejected(client):
    stored = run(publish(client, make_chunks()))
    other_prompt = PROMPT[:9] + [7] + PROMPT[10:]
    got = run(fetch_verified(client, stored, EXPECT, other_prompt))
    assert got.num_tokens == 8
    assert got.failures[0][1] == "integrity" and "token ids" in got.failures[0][2]


def test_wrong_model_is_rejected(client):
    stored = run(publish(client, make_chunks()[:1]))
    other = dataclasses.replace(EXPECT, fingerprint="tiny@2")
    got = run(fetch_verified(client, stored, other, PROMPT))
    assert not got.chunks and "fingerprint" in got.failures[0][2]


@ray.remote(num_cpus=0)
class Producer:
    """Stands in for a prefill replica: publishes chunks, then dies."""

    def publish(self, shards):
        chunks = make_chunks()
        stored = asyncio.run(publish(KVStoreClient(shards), chunks))
        # For contrast, the same bytes put the naive way: owned by this (mortal) process.
        own = [ray.put(np.frombuffer(c.encode(), dtype=np.uint8)) for c in chunks]
        return [s.key for s in stored], own


def test_published_chunks_outlive_the_producer(client):
    producer = Producer.remote()
    keys, own_refs = ray.get(producer.publish.remote(client.shards))
    assert ray.get(own_refs[0], timeout=10) is not None  # alive while the producer lives
    ray.kill(producer, no_restart=True)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(producer.publish.remote(client.shards))
    # The control shows the kill is real: objects the producer owned are gone with it...
    assert owner_death_seen(own_refs[0])
    # ...while the store's copies still verify and cover the whole prompt.
    got = run(fetch_verified(client, run(client.match_prefix(keys)), EXPECT, PROMPT, timeout_s=20))
    assert not got.failures and got.num_tokens == len(PROMPT)
    assert run(client.stats())["chunk_fetch_failures"] == 0


def owner_death_seen(ref, deadline_s: float = 30.0) -> bool:
    """Ray learns of an owner's death asynchronously: poll until a get says so."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            ray.get(ref, timeout=5)
        except ray.exceptions.OwnerDiedError:
            return True
        time.sleep(0.5)
    return False


@ray.remote(num_cpus=0)
class Mortal:
    def make(self):
        return [ray.put(np.zeros(4, dtype=np.uint8))]


def test_lost_object_is_dropped_and_counted_as_fetch_failure(client):
    stored = run(publish(client, make_chunks()))
    mortal = Mortal.remote()
    (ref,) = ray.get(mortal.make.remote())
    ray.kill(mortal, no_restart=True)
    assert owner_death_seen(ref)
    broken = [stored[0], dataclasses.replace(stored[1], ref=ref), stored[2]]
    got = run(fetch_verified(client, broken, EXPECT, PROMPT, timeout_s=20))
    assert got.num_tokens == 8 and [r for _, r, _ in got.failures] == ["fetch"]
    stats = run(client.stats())
    assert stats["chunk_fetch_failures"] == 1 and stats["chunks"] == 2


def test_partial_chunk_travels_uncached(client):
    chunks = make_chunks(PROMPT[:20])  # 8 + 8 + 4
    stored = run(publish(client, chunks[-1:], cache=False))
    assert run(client.lookup_prefix([chunks[-1].key])) == 0
    got = run(fetch_verified(client, stored, EXPECT, PROMPT[16:20]))
    assert got.failures and "starts at 16" in got.failures[0][2]  # must be contiguous from 0


def test_oversized_chunk_is_rejected_not_evicting_everything(ray_session):
    chunks = make_chunks()
    client = KVStoreClient(create_store(capacity_bytes=put_chunk_size(chunks[0]) - 1))
    stored = run(publish(client, chunks[:1]))
    assert run(client.lookup_prefix([chunks[0].key])) == 0
    assert run(client.stats())["rejected"] == 1
    got = run(fetch_verified(client, stored, EXPECT, PROMPT))  # still usable in transit
    assert got.num_tokens == 8
    ray.kill(client.shards[0])


def test_concurrent_puts_keep_the_books_straight(ray_session):
    chunks = make_chunks(list(range(1000, 1000 + 8 * 24)), chunk_tokens=8)  # 24 chunks
    sizes = {c.key: put_chunk_size(c) for c in chunks}
    client = KVStoreClient(create_store(capacity_bytes=5 * max(sizes.values()) + 10))

    async def burst():
        # The same chunks twice, all at once: duplicates must not be counted twice.
        await asyncio.gather(publish(client, chunks), publish(client, chunks[:6]))

    run(burst())
    stats = run(client.stats())
    present = ray.get(client.shards[0].keys.remote())
    assert len(present) == stats["chunks"] == 5
    assert stats["bytes"] == sum(sizes[k] for k in present)
    assert stats["puts"] - stats["evictions"] == 5
    ray.kill(client.shards[0])


def test_a_chunk_handed_over_in_band_is_verified_like_a_stored_one(client):
    """A small partial chunk may travel in-band (`StoredChunk.ref` the encoded bytes: the
    prefill replica's `in_transit`): the reader verifies it as any fetched chunk, and a
    flipped byte is an integrity failure. Seen failing (a fetch failure: TypeError, an array
    is not awaitable) with `_get` awaiting every ref."""
    from app.serve.replicas.prefill import INLINE_BYTES, in_transit

    chunks = make_chunks()
    stored = run(publish(client, chunks[:2]))
    handed = in_transit(chunks[2])
    assert isinstance(handed.ref, np.ndarray) and handed.size <= INLINE_BYTES
    got = run(fetch_verified(client, stored + [handed], EXPECT, PROMPT))
    assert not got.failures and got.num_tokens == len(PROMPT)
    bad = np.array(handed.ref)
    bad[-5] ^= 0xFF
    got = run(
        fetch_verified(client, stored + [dataclasses.replace(handed, ref=bad)], EXPECT, PROMPT)
    )
    assert [r for _, r, _ in got.failures] == ["integrity"] and got.num_tokens == 16


def test_a_large_partial_chunk_goes_in_the_object_store(ray_session, monkeypatch):
    """Above INLINE_BYTES (Ray would put a call argument that large in the object store
    anyway) the partial chunk is put by its producer and read through the ref."""
    import app.serve.replicas.prefill as prefill

    monkeypatch.setattr(prefill, "INLINE_BYTES", 16)
    handed = prefill.in_transit(make_chunks()[2])
    assert isinstance(handed.ref, ray.ObjectRef)
    assert bytes(ray.get(handed.ref)) == make_chunks()[2].encode()


def test_only_a_chunk_that_is_put_takes_a_worker_thread(ray_session, monkeypatch):
    """`all_in_transit` puts a large chunk from a worker thread (the replica's event loop
    goes on meanwhile) and hands a small one over on the loop itself (it costs nothing).
    Seen failing (hops == 1 for the small chunk) with every call going through
    asyncio.to_thread."""
    import app.serve.replicas.prefill as prefill

    hops = []

    async def to_thread(fn):
        hops.append(fn)
        return fn()

    monkeypatch.setattr(prefill.asyncio, "to_thread", to_thread)
    (small,) = run(prefill.all_in_transit([make_chunks()[2]]))
    assert isinstance(small.ref, np.ndarray) and hops == []
    monkeypatch.setattr(prefill, "INLINE_BYTES", 16)
    (large,) = run(prefill.all_in_transit([make_chunks()[2]]))
    assert isinstance(large.ref, ray.ObjectRef) and len(hops) == 1
