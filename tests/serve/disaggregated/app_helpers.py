"""What the disaggregated app's tests share besides its fixtures (conftest.py): its settings,
requests to it, expectations, and store probes."""

import asyncio
import time

import httpx
import msgpack
import numpy as np
import ray
from polling import eventually

from app import SamplingParams
from app.kv.chunk import KVChunk
from app.kv.chunk_format import ChunkFormat
from app.serve.replicas.replica import prompt_chunk_keys

MAX_TOKENS = 8
LOCAL_LIMIT = 16  # prompts of at most this many tokens prefill on the decode replica
STEP = 128  # long_prefill_chunk: a longer prompt hands off its KV in parts (overlapped)


def prompt_ids(seed: int, n: int = 380) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 300, n)]


def complete(url, prompt, replica: int | None = None, stream=False, **extra):
    headers = {} if replica is None else {"x-slimserve-prefill-replica": str(replica)}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    start = time.perf_counter()
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start


def want_text(offline, prompt) -> str:
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].text


def expectation(info) -> ChunkFormat:
    fingerprint, kv_dtype, layout = info["salt_base"]
    return ChunkFormat.from_layout(fingerprint, kv_dtype, layout, info["chunk_tokens"])


def stats(store) -> dict:
    return asyncio_run(store.stats())


def stored(store, info, prompt) -> tuple[int, int]:
    """(full chunks of ``prompt`` the store holds as a leading run, full chunks it has);
    no hit or miss is counted."""
    keys = prompt_chunk_keys(
        prompt, info["salt_base"], None, info["block_size"], info["chunk_tokens"]
    )
    return asyncio_run(store.lookup_prefix(keys)), len(keys)


def all_stored(store, info, prompt) -> bool:
    """The first token goes out before the prefill replica publishes the prompt's KV
    (docs/serving.md): wait until every full chunk is in the store."""
    return eventually(lambda: (got := stored(store, info, prompt))[0] == got[1] == 11)


def asyncio_run(coro):
    return asyncio.run(coro)


def corrupt(store, key: bytes, how: str) -> None:
    entry = asyncio_run(store.get(key))
    buf = bytes(ray.get(entry.ref))
    if how == "payload":
        bad = bytearray(buf)
        bad[-3] ^= 0x40
    else:  # a header field rewritten, tag left alone
        chunk = KVChunk.decode(buf)
        header = chunk.header_dict() | {"start_pos": chunk.meta.start_pos + 1}
        head = msgpack.packb(header, use_bin_type=True)
        bad = b"SKVC" + len(head).to_bytes(4, "little") + head + bytes(chunk.payload)
    asyncio_run(store.drop(key, "test"))
    data = np.frombuffer(bytes(bad), dtype=np.uint8)
    asyncio_run(store.put(key, data, entry.tag, list(entry.token_ids)))
