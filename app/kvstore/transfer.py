"""Publish chunks to the object store and fetch them back, verified.

Every chunk a reader uses passes :meth:`KVChunk.decode` (tag, key, and the reader's
``ChunkFormat``: fingerprint, layout, dtype) and a token check against the reader's own
prompt before it can touch a cache. A chunk that fails is dropped from the store and counted;
the reader keeps only the verified run before it, and the engine recomputes the rest.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from ray.exceptions import RayError

from app.kv.chunk import ChunkError, KVChunk
from app.kv.chunk_format import ChunkFormat
from app.kvstore.store import KVStoreClient, StoredChunk

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class FetchResult:
    chunks: list[KVChunk] = field(default_factory=list)  # the verified run from the start
    failures: list[tuple[bytes, str, str]] = field(default_factory=list)  # (key, reason, msg)
    bytes: int = 0
    fetch_s: float = 0.0  # waiting for the object store
    verify_s: float = 0.0  # decode + tag + expectations

    @property
    def num_tokens(self) -> int:
        return sum(c.meta.num_tokens for c in self.chunks)


async def publish(
    client: KVStoreClient, chunks: Sequence[KVChunk], *, cache: bool = True
) -> list[StoredChunk]:
    """Give ``chunks`` to the store, which owns them from then on; with ``cache`` they are
    also registered for prefix look-ups (a partial last chunk travels with ``cache=False``).

    Returns the leading run that was stored: a chunk whose shard cannot be reached (even after
    the client replaced it) ends the run, and its readers recompute from there."""
    done = await asyncio.gather(*(_put(client, c, cache) for c in chunks), return_exceptions=True)
    run: list[StoredChunk] = []
    for chunk, stored in zip(chunks, done):
        if isinstance(stored, RayError):
            logger.warning("KV chunk %s not stored: %s", (chunk.key or b"").hex()[:16], stored)
            break
        if isinstance(stored, BaseException):
            raise stored
        run.append(stored)
    return run


async def _put(client: KVStoreClient, chunk: KVChunk, cache: bool) -> StoredChunk:
    data = np.frombuffer(chunk.encode(), dtype=np.uint8)  # numpy: zero-copy on the way
    return await client.put(chunk.key or b"", data, chunk.tag, list(chunk.token_ids), cache)


async def fetch_verified(
    client: KVStoreClient,
    stored: Sequence[StoredChunk],
    expect: ChunkFormat,
    prompt_token_ids: Sequence[int],
    *,
    timeout_s: float = 30.0,
    verify_tag: bool = True,
    start: int = 0,
) -> FetchResult:
    """Fetch ``stored`` (consecutive chunks of the prompt, from token ``start``) and verify
    each.

    Returns the run of verified chunks before the first failure. Failed chunks are dropped
    from the store with reason "fetch" (object missing, owner died, timeout) or "integrity"
    (bad tag, wrong model/layout/key/tokens), which the store counts.

    verify_tag=False checks everything but the payload's tag: the chunks come back with
    ``verified`` False and the engine's import checks the tag in the same pass as its
    cache write (a decode replica then drops what the engine rejects: ``drop_rejected``).
    """
    result = FetchResult()
    if not stored:
        return result
    t0 = time.perf_counter()
    bufs = await asyncio.gather(*(_get(s, timeout_s) for s in stored), return_exceptions=True)
    result.fetch_s = time.perf_counter() - t0
    pos = start
    for s, buf in zip(stored, bufs):
        t1 = time.perf_counter()
        if isinstance(buf, BaseException):
            chunk, reason, msg = None, "fetch", f"{type(buf).__name__}: {buf}"
        else:
            chunk, msg = _verify(buf, s, expect, prompt_token_ids, pos, verify_tag)
            reason = "integrity"
        result.verify_s += time.perf_counter() - t1
        if chunk is None:
            # Later chunks may be sound, but without this one they cannot be used: stop.
            result.failures.append((s.key, reason, msg))
            logger.warning("dropping KV chunk %s (%s): %s", s.key.hex()[:16], reason, msg)
            break
        result.chunks.append(chunk)
        result.bytes += s.size
        pos += chunk.meta.num_tokens
    if result.failures:
        await asyncio.gather(*(client.drop(k, reason) for k, reason, _ in result.failures))
    return result


async def _get(stored: StoredChunk, timeout_s: float):
    if stored.in_band:
        return stored.ref
    try:
        return await asyncio.wait_for(stored.ref, timeout_s)
    except (RayError, asyncio.TimeoutError) as e:
        return e


def _verify(
    buf,
    stored: StoredChunk,
    expect: ChunkFormat,
    prompt_token_ids: Sequence[int],
    pos: int,
    verify_tag: bool = True,
) -> tuple[KVChunk | None, str]:
    try:
        chunk = KVChunk.decode(
            buf,
            expected_fingerprint=expect.fingerprint,
            expected_layout=expect.layout,
            expected_kv_dtype=expect.kv_dtype,
            expected_key=stored.key or None,
            verify_tag=verify_tag,
        )
    except ChunkError as e:
        return None, str(e)
    except (TypeError, ValueError) as e:  # not even a buffer
        return None, f"unreadable chunk object: {e}"
    n = chunk.meta.num_tokens
    if chunk.tag != stored.tag:
        return None, f"tag {chunk.tag:#x} differs from the store's record {stored.tag:#x}"
    if chunk.meta.start_pos != pos:
        return None, f"chunk starts at {chunk.meta.start_pos}, expected {pos}"
    if tuple(prompt_token_ids[pos : pos + n]) != chunk.token_ids or pos + n > len(prompt_token_ids):
        return None, f"chunk token ids differ from the prompt at positions {pos}..{pos + n}"
    return chunk, ""


async def drop_rejected(client: KVStoreClient, rejected: Sequence[tuple[bytes, str]]) -> None:
    """Chunks whose tag the engine's import rejected: dropped and counted like a failed fetch."""
    for key, msg in rejected:
        logger.warning("dropping KV chunk %s (integrity): %s", key.hex()[:16], msg)
    await asyncio.gather(*(client.drop(key, "integrity") for key, _ in rejected))
