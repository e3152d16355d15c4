"""The shared KV store: key -> chunk object in Ray's object store, LRU under a byte budget.

Ownership: chunks must outlive the replica that made them, so the store shard owns them. A
producer sends the encoded chunk to its shard (``put``), which ``ray.put``s it itself and
hands back the store-owned ref. Ray 2.56 removed ``ray.put(..., _owner=actor)``, the
zero-copy way for a producer to create an object another actor owns; the copy the shard
makes instead costs one memcpy of the chunk on the shard's node (bench/serve.py measures it)
and lets ownership follow the store's lifetime rather than any replica's.

Keys chain (a chunk's key names its whole prefix, see app/kv/keys.py), so a
prompt's store hit is the longest run of its chunk keys that are present.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorUnschedulableError, RayActorError

log = logging.getLogger(__name__)
# A shard that died, or cannot be placed again (its node is gone and so is any node it may
# run on): either way a new shard replaces it.
SHARD_GONE = (RayActorError, ActorUnschedulableError)


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A chunk in the object store as readers see it; ``ref`` resolves to the encoded chunk
    (a uint8 array), owned by a store shard. A small chunk handed from one replica to one
    reader (a prompt's partial last chunk, never cached) may travel in-band instead:
    ``ref`` is then the encoded chunk itself (see `PrefillServer`'s `in_transit`)."""

    key: bytes
    ref: ray.ObjectRef | np.ndarray = field(compare=False)  # an array does not compare to bool
    tag: int
    size: int
    token_ids: tuple[int, ...]

    @property
    def in_band(self) -> bool:
        """Its bytes travel with it (no Ray ref): it may be pickled outside Ray."""
        return isinstance(self.ref, np.ndarray)


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass(slots=True)
class _Entry:
    chunk: StoredChunk
    last_use: float


class KVStore:
    """One shard of the store. Run as a Ray actor: ``ray.remote(KVStore).remote(...)``."""

    def __init__(self, capacity_bytes: int, shard_id: int = 0):
        assert capacity_bytes > 0, "capacity_bytes must be positive"
        self.capacity_bytes = capacity_bytes
        self.shard_id = shard_id
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # oldest use first
        self._bytes = 0
        self._lock = threading.RLock()  # the actor runs calls on several threads
        self._counters = dict.fromkeys(
            (
                "puts",
                "hits",
                "misses",
                "evictions",
                "rejected",
                "drops",
                "integrity_failures",
                "chunk_fetch_failures",
            ),
            0,
        )

    def put(
        self, key: bytes, data: np.ndarray, tag: int, token_ids: list[int], cache: bool = True
    ) -> StoredChunk:
        """Take ownership of an encoded chunk (``data``, uint8) and return its store ref.

        With ``cache`` the chunk is also registered under ``key`` (evicting LRU entries to
        stay in budget); without, only the ref is made, for a partial chunk in transit.
        """
        with self._lock:
            if cache and key in self._entries:
                self._touch(key)
                return self._entries[key].chunk
        # The copy runs outside the lock: look-ups go on while a large chunk is stored.
        chunk = StoredChunk(key, ray.put(data), tag, int(data.nbytes), tuple(token_ids))
        if not cache:
            return chunk
        with self._lock:
            if key in self._entries:  # a concurrent put of the same chunk won
                return self._entries[key].chunk
            if chunk.size > self.capacity_bytes:
                self._counters["rejected"] += 1
                return chunk
            self._entries[key] = _Entry(chunk, time.time())
            self._bytes += chunk.size
            self._counters["puts"] += 1
            while self._bytes > self.capacity_bytes:
                self._evict_oldest()
        return chunk

    @_locked
    def lookup(self, keys: list[bytes]) -> dict[bytes, StoredChunk]:
        """The entries present among ``keys``; counts nothing (see ``record_use``)."""
        return {k: self._entries[k].chunk for k in keys if k in self._entries}

    @_locked
    def lookup_prefix(self, keys: list[bytes]) -> int:
        """Length of the longest run of ``keys``, from the first, that this shard holds."""
        run = 0
        while run < len(keys) and keys[run] in self._entries:
            run += 1
        return run

    @_locked
    def get(self, key: bytes) -> StoredChunk | None:
        entry = self._entries.get(key)
        self.record_use([key] if entry else [], 0 if entry else 1)
        return entry.chunk if entry else None

    @_locked
    def record_use(self, hit_keys: list[bytes], num_misses: int) -> None:
        """Count a lookup's outcome and refresh the LRU position of the chunks it used."""
        for key in hit_keys:
            if key in self._entries:
                self._touch(key)
                self._counters["hits"] += 1
        self._counters["misses"] += num_misses

    @_locked
    def drop(self, key: bytes, reason: str) -> bool:
        """Forget a chunk that failed a reader's check; ``reason`` is counted as a failure."""
        if reason == "integrity":
            self._counters["integrity_failures"] += 1
        elif reason == "fetch":
            self._counters["chunk_fetch_failures"] += 1
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry.chunk.size
        self._counters["drops"] += 1
        return True

    @_locked
    def keys(self) -> list[bytes]:
        return list(self._entries)

    @_locked
    def stats(self) -> dict[str, int]:
        return {
            **self._counters,
            "shard_id": self.shard_id,
            "chunks": len(self._entries),
            "bytes": self._bytes,
            "capacity_bytes": self.capacity_bytes,
        }

    def _touch(self, key: bytes) -> None:
        self._entries[key].last_use = time.time()
        self._entries.move_to_end(key)

    def _evict_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.chunk.size
        self._counters["evictions"] += 1


KVStoreActor = ray.remote(num_cpus=0, max_concurrency=8)(KVStore)
STORE_NAMESPACE = "slimserve"  # named shards live here, whatever namespace their users run in


def create_store(
    capacity_bytes: int,
    num_shards: int = 1,
    name: str | None = None,
    lifetime: str | None = None,
) -> list[ActorHandle]:
    """Start the shards (named ``{name}-{i}`` when ``name`` is set, so other processes find
    them with ``ray.get_actor``; an existing shard of that name is reused); each holds
    ``capacity_bytes / num_shards``. ``lifetime="detached"`` outlives the creating driver."""
    assert num_shards >= 1
    per_shard = capacity_bytes // num_shards
    return [_start_shard(name, i, per_shard, lifetime) for i in range(num_shards)]


def _start_shard(name: str | None, i: int, capacity: int, lifetime: str | None) -> ActorHandle:
    # A crashed shard process restarts empty (its chunks were lost with it anyway); a killed
    # one is recreated by the first client that finds it dead (KVStoreClient._replace).
    opts: dict = {"max_restarts": -1}
    if name:
        opts |= {"name": f"{name}-{i}", "namespace": STORE_NAMESPACE, "get_if_exists": True}
    if lifetime:
        opts["lifetime"] = lifetime
    return KVStoreActor.options(**opts).remote(capacity, i)


class KVStoreClient:
    """Routes keys to shards (by the key's first 8 bytes) and merges their answers.

    Built ``from_name`` with the store's capacity, it survives a shard's death: the call that
    finds a shard dead starts a new, empty one under the same name and retries once; look-ups
    that still fail count as misses, so requests recompute instead of failing.
    """

    def __init__(self, shards: list[ActorHandle], name: str | None = None, shard_capacity: int = 0):
        assert shards, "a store needs at least one shard"
        self.shards = list(shards)
        self.name, self.shard_capacity = name, shard_capacity  # for recreating a dead shard
        self.num_recreated = 0

    @classmethod
    def from_name(cls, name: str, num_shards: int, capacity_bytes: int = 0) -> KVStoreClient:
        """``capacity_bytes`` (the whole store's) lets this client recreate dead shards."""
        shards = [
            ray.get_actor(f"{name}-{i}", namespace=STORE_NAMESPACE) for i in range(num_shards)
        ]
        return cls(shards, name if capacity_bytes else None, capacity_bytes // num_shards)

    async def _call(self, i: int, method: str, *args):
        """``shards[i].method(*args)``; a dead shard is replaced once, then the call retried."""
        try:
            return await getattr(self.shards[i], method).remote(*args)
        except SHARD_GONE as e:
            if not self._replace(i, e):
                raise
        return await getattr(self.shards[i], method).remote(*args)

    def _replace(self, i: int, error: Exception) -> bool:
        if self.name is None:
            return False
        log.warning("KV store shard %s-%d is gone (%s); starting a new one", self.name, i, error)
        self.shards[i] = _start_shard(self.name, i, self.shard_capacity, "detached")
        self.num_recreated += 1
        return True

    def shard_index(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "little") % len(self.shards)

    def shard_of(self, key: bytes) -> ActorHandle:
        return self.shards[self.shard_index(key)]

    async def put(
        self, key: bytes, data: np.ndarray, tag: int, token_ids: list[int], cache: bool = True
    ) -> StoredChunk:
        """Hand an encoded chunk to its shard; returns the store-owned ref."""
        return await self._call(self.shard_index(key), "put", key, data, tag, token_ids, cache)

    async def match_prefix(self, keys: list[bytes]) -> list[StoredChunk]:
        """The stored chunks for the longest present run of ``keys``; counts hits/misses."""
        run = await self._present_run(keys)
        # Fire and forget: counting must not add a round trip to a request's TTFT.
        for i, ks in self._group([c.key for c in run]).items():
            self.shards[i].record_use.remote(ks, 0)
        if len(run) < len(keys):
            self.shard_of(keys[len(run)]).record_use.remote([], 1)
        return run

    async def lookup_prefix(self, keys: list[bytes]) -> int:
        """Length of the longest present run of ``keys`` (no counting, no LRU refresh)."""
        return len(await self._present_run(keys))

    async def get(self, key: bytes) -> StoredChunk | None:
        return await self._call(self.shard_index(key), "get", key)

    async def drop(self, key: bytes, reason: str) -> bool:
        """Forget ``key``; reason "integrity" or "fetch" also counts a failure."""
        try:
            return await self._call(self.shard_index(key), "drop", key, reason)
        except SHARD_GONE:  # the shard and the chunk are gone together
            return False

    async def stats(self) -> dict[str, int]:
        """Counters summed over shards."""
        per_shard = await asyncio.gather(*(self._call(i, "stats") for i in range(len(self.shards))))
        total: dict[str, int] = {}
        for stats in per_shard:
            for name, value in stats.items():
                if name != "shard_id":
                    total[name] = total.get(name, 0) + value
        total["shards"] = len(self.shards)
        return total

    def _group(self, keys: list[bytes]) -> dict[int, list[bytes]]:
        by_shard: dict[int, list[bytes]] = {}
        for key in keys:
            by_shard.setdefault(self.shard_index(key), []).append(key)
        return by_shard

    async def _present_run(self, keys: list[bytes]) -> list[StoredChunk]:
        groups = self._group(keys)
        answers = await asyncio.gather(
            *(self._call(i, "lookup", ks) for i, ks in groups.items()), return_exceptions=True
        )
        found: dict[bytes, StoredChunk] = {}
        for answer in answers:
            if isinstance(answer, SHARD_GONE):  # unreachable shard: its keys are misses
                log.warning("KV store look-up failed: %s", answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                found.update(answer)
        run: list[StoredChunk] = []
        for key in keys:
            if key not in found:
                break
            run.append(found[key])
        return run
