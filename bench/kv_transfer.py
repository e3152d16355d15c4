"""KV transfer, prefill cache -> decode cache, and what its integrity check costs.

Llama-3-8B-sized FP8 chunks (L=32, Hkv=8, D=128, 256 tokens: 16.9 MB each), on one node:

    encode   the chunk codec (as kv_transfer.encode_chunks calls it): copy out of the KV
             tensor into the wire buffer
    publish  into the KV store actor (app/kvstore: the store owns the objects)
    fetch    fetch_verified(verify_tag=False): object refs + framing/header/key/token checks
    import   kv_transfer.write_import into a paged KVCache (the first pass over the bytes)

Three ways of computing the xxh3 tag, side by side in one run:

    copy_tag    the tag folded in the copy itself, each byte loaded once, copied and hashed
                (slimserve_kernels/cpu_tag.py; what CPU replicas run where the C++ kernels
                build)
    same_pass   a torch copy of each layer, then the `xxhash` package over the copied bytes,
                on the copying thread (the C++ kernels off; before the copy_tag)
    overlapped  each chunk's tag hashed on a second thread (the transfer worker's tagger)
                while the copying thread moves on (xxh3 releases the GIL; CUDA replicas)

integrity = (encode with tag - encode without) + (import with tag check - without), the
"without" runs being the same code with no hashing, on warm memory (so the difference is
the hashing, not page faults); share = integrity / (encode + publish + fetch + import, the
import on a fresh cache). Every in-process stage is timed on three clocks: the copying
thread's CPU time (the previous method: for same_pass it is all the hashing work; an
oversubscribed box does not inflate it), wall time (what a transfer waits for), and the
whole process's CPU time (all threads: the hashing work wherever it runs). Publish and
fetch cross processes and are wall time. The check as a pass of its own (as fetch_verified
did once) is measured too (verify / (publish + fetch + verify)).

Beside those differences of totals: the same pass's xxh3 calls timed one by one on the
copying thread (hash_calls_*: what the tag adds there, without the subtraction's noise);
``hot_hash``, every payload byte hashed by a second call right after a first, i.e. at the
cache-hot rate (the floor: both ends hash every byte once); and ``rates``, GB/s of xxh3 and
of a torch copy on 256 KiB - 4 MiB buffers. Every share is computed within each repeat and
reported as median, quartiles and range (``shares_per_repeat``), of three denominators:
encode + publish + fetch + import (integrity_share), the same without the import's cache
write (check_share: publish + fetch + verify, the producer's encode included), and the
reader's check alone of publish + fetch + check (reader_share).

    python bench/kv_transfer.py [--chunks 8] [--repeats 7]

Writes bench/results/kv_transfer.json (also shares from the per-stage minimum over repeats
and from per-stage medians, as earlier runs reported); every repeat publishes and fetches
afresh. Run it under ``flock /tmp/slimserve-bench.lock``: the box is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_json  # noqa: E402
from bench.kv_tag_probes import hash_calls_timed, hot_hash, rates  # noqa: E402

L, HKV, D, TOKENS, BLOCK = 32, 8, 128, 256, 16
CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter, "process": time.process_time}
MODES = ("copy_tag", "same_pass", "overlapped")
# Each mode's untagged baseline: the same copies with no tag (the C++ kernel's copies for
# copy_tag, torch's for the others), so a mode's integrity is its hashing alone.
BASELINE = {"copy_tag": "kernel", "same_pass": "torch", "overlapped": "torch"}
BASELINES = ("kernel", "torch")


def _timed(fn) -> dict[str, float]:
    """fn's duration on every clock."""
    start = {name: clock() for name, clock in CLOCKS.items()}
    fn()
    return {name: clock() - start[name] for name, clock in CLOCKS.items()}


@contextlib.contextmanager
def kernel_for(mode: str | None):
    """The C++ CPU kernels on for copy_tag (the tag in the copy) and its baseline ("kernel"),
    off for every other mode (same_pass: a torch copy, then the package's xxh3)."""
    from slimserve_kernels import cpu_build

    before = os.environ.get(cpu_build.ENV)
    os.environ[cpu_build.ENV] = "1" if mode in ("copy_tag", "kernel") else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[cpu_build.ENV]
        else:
            os.environ[cpu_build.ENV] = before


def _fmt(layout: str):
    from app.kv.chunk_format import ChunkFormat

    return ChunkFormat.from_layout("bench", "fp8_e4m3", layout, TOKENS)


def _kv(n: int):
    import torch

    kv = torch.randn(L, 2, n * TOKENS, HKV, D).to(torch.float8_e4m3fn)
    return kv, torch.randint(-8, 4, (L, 2, n * TOKENS, HKV), dtype=torch.int8)


def parts(fmt, prompt, kv) -> tuple[list, dict[str, float]]:
    """The (meta, kv, scales) of each chunk, as encode_chunks makes them, and the time of
    its chunk keys and BLAKE2b prefix digests (app/kv/keys.py), reported beside the tag."""
    from app.kv.keys import chunk_hash

    out, parent = [], None

    def make():
        nonlocal parent
        for start in range(0, len(prompt), TOKENS):
            tokens = tuple(prompt[start : start + TOKENS])
            h = chunk_hash(parent, tokens, b"salt", BLOCK, True)
            sl = slice(start, start + TOKENS)
            out.append((fmt.meta(tokens, start, h, parent), kv[0][:, :, sl], kv[1][:, :, sl]))
            parent = h

    return out, _timed(make)


def encode(chunk_parts, mode: str, tagger):
    """(times, chunks): the chunk codec as encode_chunks calls it (copy_tag, same_pass:
    KVChunk.from_tensors; overlapped: from_tensors_overlapped on the tagger); a baseline
    ("kernel", "torch"): the same copies into the same buffers with no hashing at all."""
    from app.kv import chunk as codec

    got = []
    with kernel_for(mode):
        if mode in BASELINES:
            return _timed(lambda: [codec._wire(*part, None) for part in chunk_parts]), None
        if mode == "overlapped":
            t = _timed(
                lambda: got.extend(codec.KVChunk.from_tensors_overlapped(chunk_parts, tagger))
            )
        else:
            t = _timed(
                lambda: got.extend(codec.KVChunk.from_tensors(*part) for part in chunk_parts)
            )
    return t, got


def import_into(cache, fmt, chunks, mode: str, tagger) -> dict[str, float]:
    """write_import of every chunk into fresh blocks; a baseline ("kernel", "torch"): marked
    verified, so the same writes run with no tag check."""
    from app.engine import kv_transfer
    from app.engine.block_manager import ImportHold

    blocks = list(range(len(chunks) * TOKENS // BLOCK))
    hold = ImportHold(blocks, [None] * len(blocks), list(blocks))
    if mode in BASELINES:
        chunks = [dataclasses.replace(c, verified=True) for c in chunks]
    pool = tagger if mode == "overlapped" else None
    with kernel_for(mode):
        return _timed(lambda: kv_transfer.write_import(cache, fmt, chunks, hold, pool))


def one_repeat(client, fmt, chunk_parts, new_cache, prompt, tagger, turn: int = 0) -> dict:
    from app.kvstore.transfer import fetch_verified, publish

    enc: dict = {m: [] for m in (*MODES, *BASELINES)}
    chunks = None
    # Alternate, and rotate the order from repeat to repeat (turn): the first encode after
    # the imports finds its source out of cache and fresh wire pages to fault in, which
    # would otherwise always fall on the same mode.
    modes = (*MODES[turn % len(MODES) :], *MODES[: turn % len(MODES)])
    for mode in (*modes, *BASELINES, *modes[::-1], *BASELINES[::-1], *modes, *BASELINES):
        t, out = encode(chunk_parts, mode, tagger)
        enc[mode].append(t)
        chunks = out or chunks
    t = time.perf_counter()
    stored = asyncio.run(publish(client, chunks))
    publish_s = time.perf_counter() - t
    t = time.perf_counter()
    got = asyncio.run(fetch_verified(client, stored, fmt, prompt, verify_tag=False))
    fetch_s = time.perf_counter() - t
    assert not got.failures and not any(c.verified for c in got.chunks)
    cold = {m: import_into(new_cache(), fmt, got.chunks, m, tagger) for m in MODES}
    warm: dict = {m: [] for m in (*MODES, *BASELINES)}
    cache = new_cache()
    import_into(cache, fmt, got.chunks, "torch", tagger)  # first touch
    for mode in (*BASELINES, *modes, *BASELINES[::-1], *modes[::-1], *BASELINES, *modes):
        warm[mode].append(import_into(cache, fmt, got.chunks, mode, tagger))
    with hash_calls_timed() as encode_hashing:
        encode(chunk_parts, "same_pass", tagger)
    with hash_calls_timed() as import_hashing:
        import_into(cache, fmt, got.chunks, "same_pass", tagger)
    serial = _timed(lambda: [c.verify_tag() for c in got.chunks])
    hot = hot_hash(got.chunks)
    asyncio.run(drop_all(client, stored))
    out = {"publish_s": publish_s, "fetch_s": fetch_s, "hot_hash_wall_s": hot}
    out["hash_calls_encode_s"], out["hash_calls_import_s"] = encode_hashing[0], import_hashing[0]
    for clock in CLOCKS:
        for base in BASELINES:  # three runs each, the least disturbed kept
            out[f"encode_untagged_{base}_{clock}_s"] = min(r[clock] for r in enc[base])
            out[f"import_unchecked_{base}_{clock}_s"] = min(r[clock] for r in warm[base])
        out[f"serial_verify_{clock}_s"] = serial[clock]
        for m in MODES:
            out[f"encode_{m}_{clock}_s"] = min(r[clock] for r in enc[m])
            out[f"import_cold_{m}_{clock}_s"] = cold[m][clock]
            out[f"import_{m}_{clock}_s"] = min(r[clock] for r in warm[m])
    return out


async def drop_all(client, stored) -> None:
    await asyncio.gather(*(client.drop(s.key, "evict") for s in stored))


def shares(t: dict, mode: str, clock: str) -> dict:
    """Integrity cost and shares of one mode on one clock, from one set of stage times.

    integrity_share: of encode + publish + fetch + import (the cache write included);
    check_share: the same integrity of encode + publish + fetch + the import's check alone
    (no cache write: publish + fetch + verify, the producer's tag and its encode counted);
    reader_share: the import's check alone of publish + fetch + check (the old measure's
    terms, the check in the import's pass instead of a pass of its own);
    signed_share: integrity_share without flooring each end's difference at 0 (a tagged
    copy measured faster than its untagged baseline shows as negative, not hidden)."""
    base = BASELINE[mode]
    signed_encode = t[f"encode_{mode}_{clock}_s"] - t[f"encode_untagged_{base}_{clock}_s"]
    signed_import = t[f"import_{mode}_{clock}_s"] - t[f"import_unchecked_{base}_{clock}_s"]
    tag_encode, tag_import = max(0.0, signed_encode), max(0.0, signed_import)
    moved = t[f"encode_{mode}_{clock}_s"] + t["publish_s"] + t["fetch_s"]
    transfer = moved + t[f"import_cold_{mode}_{clock}_s"]
    reader = t["publish_s"] + t["fetch_s"] + tag_import
    return {
        "integrity_s": tag_encode + tag_import,
        "integrity_encode_s": tag_encode,
        "integrity_import_s": tag_import,
        "transfer_s": transfer,
        "integrity_share": (tag_encode + tag_import) / transfer,
        "check_share": (tag_encode + tag_import) / (moved + tag_import),
        "reader_share": tag_import / reader,
        "signed_share": (signed_encode + signed_import) / transfer,
    }


def all_shares(t: dict) -> dict:
    out = {f"{m}/{c}": shares(t, m, c) for m in MODES for c in CLOCKS}
    serial = t["serial_verify_thread_s"]
    out["separate_pass_share"] = serial / (t["publish_s"] + t["fetch_s"] + serial)
    # Both ends hashing every byte at the cache-hot rate (hot_hash: one side), of the same
    # pass's transfer: what no same-pass tag can go under on this machine.
    transfer = shares(t, "same_pass", "thread")["transfer_s"]
    out["floor_share"] = 2 * t["hot_hash_wall_s"] / transfer
    # The same pass's hashing timed call by call on the copying thread (not a difference of
    # two noisy totals), of the same denominators.
    hashing = t["hash_calls_encode_s"] + t["hash_calls_import_s"]
    moved = transfer - t["import_cold_same_pass_thread_s"]
    out["same_pass_hash_calls_share"] = hashing / transfer
    out["same_pass_hash_calls_check_share"] = hashing / (moved + t["hash_calls_import_s"])
    return out


def spread(runs: list[dict]) -> dict:
    """Each share computed within each repeat (every stage of one repeat), then its median,
    quartiles and range over the repeats: how far one run's number can be trusted."""
    per_run = [all_shares(r) for r in runs]
    out = {}
    for key, first in per_run[0].items():
        names = (
            ("integrity_share", "check_share", "reader_share", "signed_share")
            if isinstance(first, dict)
            else (None,)
        )
        for name in names:
            vals = sorted(s[key][name] if name else s[key] for s in per_run)
            q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else vals * 3
            label = f"{key}:{name}" if name else key
            out[label] = {
                "median": statistics.median(vals),
                "p25": q[0],
                "p75": q[2],
                "min": vals[0],
                "max": vals[-1],
            }
    return out


def summarize(runs: list[dict], chunk_bytes: int, num_chunks: int) -> dict:
    """Shares within each repeat (median and spread: the headline), and from the per-stage
    minimum over repeats (the least disturbed run of each stage, mixed across repeats) and
    per-stage medians, for comparison with earlier runs."""
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "load_average_1m": os.getloadavg()[0],  # a shared box: how disturbed the runs were
        "shares_per_repeat": spread(runs),
        "chunk_bytes": chunk_bytes,
        "num_chunks": num_chunks,
        "repeats": len(runs),
        "min_s": best,
        "median_s": med,
        "shares": all_shares(best),
        "shares_from_medians": all_shares(med),
        "runs": runs,
    }


def measure(client, num_chunks: int, repeats: int) -> dict:
    """The whole comparison against a running KV store (``client``; Ray already up): what
    main() writes, and what bench/serve.py reports as its chunk transfer's integrity."""
    import torch

    from app.engine.kv_cache import KVCache
    from app.kv.layout import KVCacheSpec

    spec = KVCacheSpec(L, HKV, D, BLOCK, "fp8_e4m3")
    fmt, prompt = _fmt(spec.layout), list(range(num_chunks * TOKENS))
    chunk_parts, digests = parts(fmt, prompt, _kv(num_chunks))
    new_cache = lambda: KVCache(spec, num_chunks * TOKENS // BLOCK, "cpu")  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="kv-tag") as tagger:
            runs = [
                one_repeat(client, fmt, chunk_parts, new_cache, prompt, tagger, turn)
                for turn in range(repeats)
            ]
    finally:
        torch.set_num_threads(threads)
    result = summarize(runs, fmt.spec.bytes_per_token() * TOKENS, num_chunks)
    result["keys_and_prefix_digests_s"] = digests  # per side; not in the tag's share
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    import ray

    from app.kvstore.store import KVStoreClient, create_store

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        client = KVStoreClient(create_store(4 << 30))
        ray.get(client.shards[0].stats.remote())  # actor start-up is not transfer time
        load_before = os.getloadavg()[0]
        result = measure(client, a.chunks, a.repeats)
        result["load_average_1m_before"] = load_before
        result["rates_gb_s"] = rates()
    finally:
        ray.shutdown()
    path = write_json("kv_transfer", result)
    _print(result)
    print(f"-> {path}")
    return 0


def _print(result: dict) -> None:
    for k, v in result["rates_gb_s"].items():
        print(f"{k:<36}{v:>10.1f} GB/s")
    print(f"{'stage':<36}{'min ms':>10}{'median ms':>11}")
    for k, v in result["min_s"].items():
        print(f"{k:<36}{v * 1e3:>10.2f}{result['median_s'][k] * 1e3:>11.2f}")
    print(f"{'share, per repeat':<44}{'median':>8}{'p25':>8}{'p75':>8}{'min':>8}{'max':>8}")
    for key, s in result["shares_per_repeat"].items():
        cols = "".join(f"{s[q]:>8.2%}" for q in ("median", "p25", "p75", "min", "max"))
        print(f"{key:<44}{cols}")
    med = result["shares_from_medians"]
    for key, s in result["shares"].items():
        if not isinstance(s, dict):
            print(f"{key:<36}{s:>10.2%}{med[key]:>11.2%} (stage min / stage medians)")
            continue
        print(
            f"{key:<22} integrity {s['integrity_s'] * 1e3:6.2f} ms of "
            f"{s['transfer_s'] * 1e3:7.2f} ms = {s['integrity_share']:6.2%}"
            f" (stage medians {med[key]['integrity_share']:6.2%})"
        )


if __name__ == "__main__":
    sys.exit(main())
