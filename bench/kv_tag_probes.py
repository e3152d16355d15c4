"""What a chunk tag's hashing costs at its fastest here, beside bench/kv_transfer.py's
transfer (which imports these): the same pass's xxh3 calls timed one by one, every payload
byte hashed at the cache-hot rate (the floor), and GB/s of xxh3 and of a torch copy."""

from __future__ import annotations

import contextlib
import time


class _TimedHasher:
    """An xxh3 hasher that adds the wall time of its ``update`` calls to ``spent[0]``: in
    the same pass, exactly the time the tag takes on the copying thread."""

    def __init__(self, hasher, spent: list[float]):
        self._hasher, self._spent = hasher, spent

    def update(self, piece) -> None:
        t = time.perf_counter()
        self._hasher.update(piece)
        self._spent[0] += time.perf_counter() - t

    def intdigest(self) -> int:
        return self._hasher.intdigest()


@contextlib.contextmanager
def hash_calls_timed():
    """Every chunk tag hasher made inside (the encode's and the import's) is timed."""
    from app.kv import chunk as codec

    spent, real = [0.0], codec.tag_hasher
    # copying ignored: the same pass as it ran before the tag moved into the copy (a torch
    # copy, then these calls), so this times what that move took off the copying thread
    codec.tag_hasher = lambda meta, n, copying=False: _TimedHasher(real(meta, n), spent)
    try:
        yield spent
    finally:
        codec.tag_hasher = real


def hot_hash(chunks) -> float:
    """One side's hashing at its fastest (wall seconds): xxh3 ``update`` over every payload
    byte in the pieces the import feeds (a layer's K and V), each piece hashed once untimed
    to bring it into cache, then timed. No same-pass tag can cost less than this per side."""
    total = 0.0
    for chunk in chunks:
        kv, _ = chunk.to_tensors()
        per_layer = kv[0].numel() * kv.element_size()
        for off in range(0, chunk.nbytes, per_layer):
            piece, hasher = chunk.payload[off : off + per_layer], chunk.tag_hasher()
            hasher.update(piece)
            t = time.perf_counter()
            hasher.update(piece)
            total += time.perf_counter() - t
    return total


def rates(repeats: int = 5) -> dict[str, float]:
    """GB/s of the venv's xxh3_64 (one-shot and streaming ``update``) and of a torch copy on
    256 KiB - 4 MiB buffers: "hot" re-reads one buffer (cache-resident up to L2's size),
    "cold" walks 256 MiB so every read comes from memory. Best of ``repeats``."""
    import torch

    pool = torch.randint(0, 255, (256 << 20,), dtype=torch.uint8)
    dst = torch.empty_like(pool)
    out = {}
    for size in (256 << 10, 1 << 20, 4 << 20):
        n = (512 << 20) // size  # bytes moved per timing: 512 MiB
        for where, step in (("hot", 0), ("cold", size)):
            offs = [(i * step) % (pool.numel() - size + 1) for i in range(n)]
            for kind, fn in _rate_fns(pool, dst, offs, size).items():
                best = min(_wall(fn) for _ in range(repeats))
                out[f"{kind}_{where}_{size >> 10}KiB_gb_s"] = n * size / best / 1e9
    return out


def _rate_fns(pool, dst, offs: list[int], size: int) -> dict:
    import xxhash

    views = [memoryview(pool[o : o + size].numpy()) for o in offs]
    hasher = xxhash.xxh3_64()  # one streaming state fed every piece, as a chunk's tag is
    pairs = [(dst[o : o + size], pool[o : o + size]) for o in offs]
    fns = {
        "xxh3_oneshot": lambda: [xxhash.xxh3_64_intdigest(v) for v in views],
        "xxh3_update": lambda: [hasher.update(v) for v in views],
        "torch_copy": lambda: [d.copy_(s) for d, s in pairs],
    }
    from slimserve_kernels import cpu_tag

    if cpu_tag.available():  # the tag in the copy, and the same copy loop without it
        tag, ext = cpu_tag.CopyingTag(), cpu_tag.load()
        fns["copy_tag"] = lambda: [tag.copy(d, s) for d, s in pairs]
        fns["kernel_copy"] = lambda: [ext.copy_only(d, s) for d, s in pairs]
    return fns


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
