"""Chained block keys for the prefix cache and the shared KV store.

key_i = xxh3_128(key_{i-1} ‖ token_ids of block i ‖ salt). Because keys chain, a block's
key names the whole prefix up to its end; the salt folds in the model fingerprint, the KV
dtype and layout, and the request's cache_salt so tenants and formats never share blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

LAYOUT_VERSION = "paged-v1"


def block_key(parent: bytes | None, token_ids: Sequence[int], salt: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(parent or b"\x00" * 16)
    h.update(array("q", token_ids).tobytes())
    h.update(salt)
    return h.digest()


def make_salt(fingerprint: str, kv_dtype: str, layout: str, cache_salt: str | None) -> bytes:
    parts = (fingerprint, kv_dtype, layout, cache_salt or "")
    # Length-prefixed so ("ab", "c") and ("a", "bc") never collide.
    return b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)


def chain_keys(
    token_ids: Sequence[int], block_size: int, salt: bytes, parent: bytes | None = None
) -> list[bytes]:
    """Keys of every full block of token_ids."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start : start + block_size], salt)
        keys.append(parent)
    return keys
