"""Block keys (the fast lookup) and prefix digests (the proof) for cached and exported KV.

key_i = xxh3_128(key_{i-1} ‖ token ids of block i ‖ salt). Because keys chain, a block's key
names the whole prefix up to its end; the salt folds in the model fingerprint, the KV dtype
and layout, and the request's cache_salt, so tenants and formats never share blocks.

xxh3 is fast but not collision resistant: someone who crafts prompts can make two prefixes
share a key. So every hit, local or imported, is also checked against a digest:

    digest_i = BLAKE2b-256(digest_{i-1} ‖ n_i ‖ token ids of block i ‖ salt), digest_{-1} = 0^32

with n_i the block's token count (so token ids and salt cannot trade bytes). Each step feeds
the previous digest into a collision-resistant hash, so equal digests mean equal salt and
equal token ids all the way from position 0 (a difference anywhere would be a BLAKE2b
collision in some step). Computing it per block costs O(block), not O(prefix)
(bench/prefix_digest.py measures it; docs/kv_cache.md).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

import xxhash

DIGEST_BYTES = 32
_ROOT = b"\x00" * DIGEST_BYTES


class BlockHash(NamedTuple):
    """A full block's (or a chunk's) identity: key to find it, digest to prove it."""

    key: bytes  # xxh3_128 chain
    digest: bytes  # BLAKE2b-256 chain


def block_key(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    h.update(salt)
    return h.digest()


def block_digest(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=DIGEST_BYTES)
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    h.update(salt)
    return h.digest()


def next_hash(parent: BlockHash | None, token_ids: Sequence[int], salt: bytes) -> BlockHash:
    """The hash of a block (or chunk) of token_ids that follows parent (None: position 0)."""
    key = block_key(parent.key if parent else None, token_ids, salt)
    return BlockHash(key, block_digest(parent.digest if parent else None, token_ids, salt))


def make_salt(fingerprint: str, kv_dtype: str, layout: str, cache_salt: str | None) -> bytes:
    parts = (fingerprint, kv_dtype, layout, cache_salt or "")
    # Length-prefixed so ("ab", "c") and ("a", "bc") never collide.
    return b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)


def chain_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Hashes of every full block of token_ids."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_hash(parent, token_ids[start : start + block_size], salt)
        hashes.append(parent)
    return hashes


def chain_keys(token_ids: Sequence[int], block_size: int, salt: bytes) -> list[bytes]:
    """Keys of every full block of token_ids (the store's lookup keys)."""
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], salt)
        keys.append(parent)
    return keys


def chunk_hash(
    parent: BlockHash | None, token_ids: Sequence[int], salt: bytes, block_size: int, full: bool
) -> BlockHash:
    """A full chunk chains its blocks (its hash is its last block's); a partial one (the end
    of a prompt) hashes its tokens in one step."""
    if not full:
        return next_hash(parent, token_ids, salt)
    return chain_hashes(token_ids, block_size, salt, parent)[-1]
