"""Chunk tags hashed on a second thread (the transfer worker's tagger) give exactly what the
same-pass tag gives: the same bytes on the wire, the same chunk rejected on import (no model,
no Ray). Every test runs with the C++ CPU kernels on (the same pass hashes inside the copies:
slimserve_kernels/cpu_tag.py) and off (a copy, then the `xxhash` package)."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.engine.block_manager import ImportHold
from app.engine.kv_cache import KVCache
from app.engine.kv_transfer import encode_chunks, write_import
from app.kv.chunk import ChunkError, KVChunk
from app.kv.chunk_format import ChunkFormat
from app.kv.layout import KVCacheSpec
from slimserve_kernels import cpu_tag

FMT = ChunkFormat("tiny@1", KVCacheSpec(3, 2, 8, 4, "fp8_e4m3"), chunk_tokens=8)
TOKENS = list(range(100, 124))  # three chunks of 8 tokens, two blocks each


@pytest.fixture(autouse=True, params=["kernel on", "kernel off"])
def kernel(request, monkeypatch):
    if request.param == "kernel off":
        monkeypatch.setenv("SLIMSERVE_CPU_KERNELS", "0")
    elif not cpu_tag.available():
        pytest.skip("the C++ CPU kernels did not build here")
    return request.param


@pytest.fixture(scope="module")
def tagger():
    with ThreadPoolExecutor(1) as pool:
        yield pool


@pytest.fixture(scope="module")
def kv():
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(3, 2, 24, 2, 8, generator=g) * 3).to(torch.float8_e4m3fn)
    return kv, torch.randint(-8, 4, (3, 2, 24, 2), dtype=torch.int8, generator=g)


def test_overlapped_encode_is_the_same_pass_encode(kv, tagger):
    """Seen failing: with tagging._feed skipping each piece's last byte, every wire
    differed (its tag) and the tagger import cases below failed too."""
    same_pass = encode_chunks(FMT, TOKENS, *kv, b"salt")
    overlapped = encode_chunks(FMT, TOKENS, *kv, b"salt", tagger)
    assert [bytes(c.encode()) for c in overlapped] == [bytes(c.encode()) for c in same_pass]
    for chunk in overlapped:
        KVChunk.decode(chunk.encode()).verify_tag()


# Offsets into chunk 1's payload: layer 0's first K byte, a V byte of the last layer, the
# last byte (a scale): any payload byte counts, not only the ones a sample would touch.
DAMAGE = {"first byte": 0, "last layer": 3 * 2 * 8 * 2 * 8 - 3, "last scale": -1}


@pytest.mark.parametrize("where", list(DAMAGE))
@pytest.mark.parametrize("overlapped", [False, True], ids=["same pass", "tagger"])
def test_import_rejects_a_flipped_bit_and_keeps_the_chunks_before(kv, tagger, where, overlapped):
    """Seen failing: with _first_mismatch returning None (tags computed, never compared), the
    tagger cases kept all 6 blocks and reported nothing; with the tag check dropped from
    _write_chunk, the same-pass cases did."""
    chunks = encode_chunks(FMT, TOKENS, *kv, b"salt")
    wires = [bytearray(c.encode()) for c in chunks]
    wires[1][len(wires[1]) - chunks[1].nbytes + DAMAGE[where] % chunks[1].nbytes] ^= 0x08
    offered = [KVChunk.decode(bytes(w), verify_tag=False) for w in wires]
    cache = KVCache(FMT.spec, 8, "cpu")
    hold = ImportHold(list(range(6)), [], list(range(6)))
    valid, rejected = write_import(cache, FMT, offered, hold, tagger if overlapped else None)
    assert valid == 2  # chunk 0's two blocks
    ((key, why),) = rejected
    assert key == chunks[1].key and "tag mismatch" in why
    want = kv[0][:, :, :8].reshape(3, 2, 2, 4, 2, 8)  # [L, P, blocks, bs, Hkv, D]
    assert torch.equal(cache.kv[:, :, :2].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("overlapped", [False, True], ids=["same pass", "tagger"])
def test_undamaged_import_keeps_every_block(kv, tagger, overlapped):
    chunks = encode_chunks(FMT, TOKENS, *kv, b"salt")
    offered = [KVChunk.decode(bytes(c.encode()), verify_tag=False) for c in chunks]
    cache = KVCache(FMT.spec, 8, "cpu")
    hold = ImportHold(list(range(6)), [], list(range(6)))
    assert write_import(cache, FMT, offered, hold, tagger if overlapped else None) == (6, [])
    want = kv[0].reshape(3, 2, 6, 4, 2, 8)
    assert torch.equal(cache.kv[:, :, :6].view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("overlapped", [False, True], ids=["same pass", "tagger"])
def test_checked_and_cached_chunks_before_a_damaged_one(kv, tagger, overlapped):
    """Chunk 0 was checked at fetch and its blocks are cached here (nothing to write or
    check), chunk 1 is damaged, chunk 2 sound: the import keeps chunk 0's blocks only.

    Seen failing (tagger case): with no tag slot kept for chunk 0, chunk 1's tag was
    compared with chunk 0's header and chunk 0 was rejected (0 valid blocks)."""
    chunks = encode_chunks(FMT, TOKENS, *kv, b"salt")
    wires = [bytearray(c.encode()) for c in chunks]
    wires[1][-1] ^= 0x01
    offered = [KVChunk.decode(bytes(wires[0]))]
    offered += [KVChunk.decode(bytes(w), verify_tag=False) for w in wires[1:]]
    hold = ImportHold(list(range(6)), [], [2, 3, 4, 5])  # blocks 0, 1: cached
    cache = KVCache(FMT.spec, 8, "cpu")
    valid, rejected = write_import(cache, FMT, offered, hold, tagger if overlapped else None)
    assert valid == 2 and [k for k, _ in rejected] == [chunks[1].key]


def test_same_pass_copies_in_the_tag_when_the_kernel_is_on(kv, kernel, monkeypatch):
    """With the kernel on, the encode and the import copy through the tag (each byte read
    once); off, neither does. Either way every block is written and valid."""
    calls = []
    for name in ("copy_planes", "copy_blocks"):
        real = getattr(cpu_tag, name)
        monkeypatch.setattr(
            cpu_tag, name, lambda *a, n=name, f=real: calls.append((n, a[-1] is not None)) or f(*a)
        )
    chunks = encode_chunks(FMT, TOKENS, *kv, b"salt")
    offered = [KVChunk.decode(bytes(c.encode()), verify_tag=False) for c in chunks]
    cache = KVCache(FMT.spec, 8, "cpu")
    valid, bad = write_import(cache, FMT, offered, ImportHold(list(range(6)), [], list(range(6))))
    assert (valid, bad) == (6, [])
    on = kernel == "kernel on"
    # with the tag (never without it: these chunks are all unverified)
    assert {n for n, tagged in calls if tagged} == ({"copy_planes", "copy_blocks"} if on else set())
    assert all(tagged for _, tagged in calls), calls


def test_export_takes_the_chunk_hashes_the_block_manager_made(kv):
    """A full chunk's key and digest are its last block's (Sequence.block_hashes), so the
    export reuses them instead of hashing the tokens again; the chunks are the same bytes.

    Seen failing: with the next block's hash taken (block_hashes[end // bs], clamped), the
    wires differed."""
    from app.kv.keys import chain_hashes

    made = chain_hashes(TOKENS[:20], FMT.spec.block_size, b"salt")  # 5 of 6 blocks known
    again = encode_chunks(FMT, TOKENS, *kv, b"salt", block_hashes=made)
    fresh = encode_chunks(FMT, TOKENS, *kv, b"salt")
    assert [bytes(c.encode()) for c in again] == [bytes(c.encode()) for c in fresh]


@pytest.mark.parametrize("overlapped", [False, True], ids=["same pass", "tagger"])
def test_every_flipped_byte_is_rejected_before_use(kv, tagger, overlapped):
    """One flipped bit in any byte of a chunk (framing, header, K, V, scales: every offset
    of the wire, not a sample) is rejected before the KV is used: by the fetch's header and
    expectation checks (as app/kvstore/transfer.py decodes, the tag left to the import), or
    by the import's tag check, which then keeps only the blocks before the chunk.

    Seen failing, each time at the first byte left out: with the scales left out of the tag
    at both ends (encode `_fill`, import `_write_chunk`, `compute_tag`), offset 1005 (a scale)
    was written and kept; with the header left out (`tag_hasher` fed nothing), offset 116."""
    chunks = encode_chunks(FMT, TOKENS, *kv, b"salt")
    sound = [KVChunk.decode(bytes(c.encode()), verify_tag=False) for c in chunks]
    wire = bytes(chunks[1].encode())
    by_fetch = by_import = 0
    for offset in range(len(wire)):
        damaged = bytearray(wire)
        damaged[offset] ^= 1 << offset % 8
        try:
            offered = KVChunk.decode(
                bytes(damaged),
                expected_fingerprint=FMT.fingerprint,
                expected_layout=FMT.layout,
                expected_kv_dtype=FMT.kv_dtype,
                expected_key=chunks[1].key,
                expected_token_ids=chunks[1].token_ids,
                verify_tag=False,
            )
        except ChunkError:
            by_fetch += 1
            continue
        hold = ImportHold(list(range(6)), [], list(range(6)))
        cache = KVCache(FMT.spec, 8, "cpu")
        valid, rejected = write_import(
            cache, FMT, [sound[0], offered, sound[2]], hold, tagger if overlapped else None
        )
        assert (valid, [k for k, _ in rejected]) == (2, [chunks[1].key]), offset
        by_import += 1
    assert by_fetch + by_import == len(wire)
    assert by_import > chunks[1].nbytes  # every payload byte reaches (and fails) the import
