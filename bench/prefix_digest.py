"""Cost of exact prefix hits: the BLAKE2b prefix digest per block beside the xxh3 key.

Every full block is hashed twice (app/kv/keys.py): the xxh3_128 key finds a cached block,
the BLAKE2b-256 digest proves its whole prefix and salt equal. This times both per block for
a range of block sizes, and the whole chain of a long prompt, on this machine's CPU.

    python bench/prefix_digest.py   ->  bench/results/prefix_digest.json
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from app.kv.keys import block_digest, block_key, chain_hashes, make_salt  # noqa: E402
from bench.common import write_json  # noqa: E402

SALT = make_salt("0123456789abcdef", "fp8_e4m3", "paged-v1:L32:H8:D128:B16:tp1", "tenant-a")


def per_call_us(fn, parent: bytes, tokens: list[int], repeat: int) -> float:
    best = float("inf")
    for _ in range(5):  # best of 5: the least disturbed run on a shared machine
        t = time.perf_counter()
        for _ in range(repeat):
            fn(parent, tokens, SALT)
        best = min(best, time.perf_counter() - t)
    return best / repeat * 1e6


def main() -> None:
    rows = []
    for block_size in (16, 32, 64, 128):
        tokens = list(range(1000, 1000 + block_size))
        key_us = per_call_us(block_key, b"\x01" * 16, tokens, 20000)
        digest_us = per_call_us(block_digest, b"\x01" * 32, tokens, 20000)
        rows.append(
            {
                "block_size": block_size,
                "xxh3_key_us": round(key_us, 3),
                "blake2b_digest_us": round(digest_us, 3),
                "digest_ns_per_token": round(digest_us * 1000 / block_size, 1),
            }
        )
        print(rows[-1])
    prompt = list(range(8192))
    t = time.perf_counter()
    chain_hashes(prompt, 16, SALT)
    chain_ms = (time.perf_counter() - t) * 1e3
    print(f"key + digest chain of an 8192-token prompt (512 blocks of 16): {chain_ms:.2f} ms")
    write_json("prefix_digest", {"per_block": rows, "chain_8192_tokens_bs16_ms": chain_ms})


if __name__ == "__main__":
    main()
