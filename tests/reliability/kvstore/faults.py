"""A store shard whose entries a test can damage, and the faults a chunk reader must survive.

Each fault changes what a real shard hands its readers for one key, the way the fault would
in production: the object's bytes rot or arrive cut short, two chunks' payloads trade places
under their own (valid) headers, the object is lost, or the shard answers a key with another
chunk (misfiled). The shard's record (tag, token ids, size) stays as stored unless the fault
is a misfiled record.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import ray

from app.kv.chunk import KVChunk
from app.kvstore.store import KVStore, StoredChunk

FAULTS = ("flip", "truncate", "swap", "lost", "other_key")


class FaultyShard(KVStore):
    """KVStore plus ``corrupt``: rewrite what the shard returns for a key."""

    def corrupt(self, key: bytes, data: np.ndarray | None, record: dict) -> None:
        """Point ``key``'s entry at a new object made of ``data`` (or at ``record["ref"]``,
        wrapped in a list so Ray passes the ref itself), with ``record``'s fields replaced."""
        with self._lock:
            entry = self._entries[key]
            fields = dict(record)
            if data is not None:
                fields["ref"] = ray.put(data)
            elif "ref" in fields:
                (fields["ref"],) = fields["ref"]
            entry.chunk = dataclasses.replace(entry.chunk, **fields)


FaultyShardActor = ray.remote(num_cpus=0, max_concurrency=8)(FaultyShard)


@ray.remote(num_cpus=0)
class _Mortal:
    def make(self, size: int) -> list[ray.ObjectRef]:
        return [ray.put(np.zeros(size, dtype=np.uint8))]


def lost_ref(size: int) -> ray.ObjectRef:
    """A ref whose owner has died, so its object is gone for good (checked by a get)."""
    mortal = _Mortal.remote()
    (ref,) = ray.get(mortal.make.remote(size))
    ray.kill(mortal, no_restart=True)
    for _ in range(60):  # Ray learns of the owner's death asynchronously
        try:
            ray.get(ref, timeout=5)
        except ray.exceptions.OwnerDiedError:
            return ref
        time.sleep(0.5)
    raise AssertionError("the object outlived its owner")


def apply_fault(shard, fault: str, victim: StoredChunk, other: StoredChunk) -> None:
    """Damage what ``shard`` returns for ``victim.key``; ``other`` is a sound chunk of the
    same size (the next chunk of the prompt, or the same position under another prefix)."""
    raw, other_raw = bytes(ray.get(victim.ref)), bytes(ray.get(other.ref))
    data, record = None, {}
    if fault == "swap":  # and the other way round: each header over the other's payload
        put(shard, other.key, _swapped(other_raw, raw), {})
    if fault == "flip":  # one bit near the payload's end (an FP8 scale)
        bad = bytearray(raw)
        bad[-7] ^= 0x10
        data = bad
    elif fault == "truncate":
        data = raw[: len(raw) // 2]
    elif fault == "swap":
        data = _swapped(raw, other_raw)
    elif fault == "lost":
        record = {"ref": [lost_ref(victim.size)]}
    elif fault == "other_key":  # a consistent record of another chunk, filed under this key
        data = other_raw
        record = {"tag": other.tag, "token_ids": other.token_ids}
    else:
        raise ValueError(fault)
    put(shard, victim.key, data, record)


def put(shard, key: bytes, data: bytes | bytearray | None, record: dict) -> None:
    array = None if data is None else np.frombuffer(bytes(data), dtype=np.uint8)
    ray.get(shard.corrupt.remote(key, array, record))


def _swapped(raw: bytes, other_raw: bytes) -> bytes:
    """``raw``'s valid header (its tag too) over ``other_raw``'s payload of the same size."""
    payload, other_payload = KVChunk.decode(raw).payload, KVChunk.decode(other_raw).payload
    assert len(payload) == len(other_payload)
    return raw[: len(raw) - len(payload)] + bytes(other_payload)
