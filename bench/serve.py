"""Serving benchmark: a streaming HTTP load generator against the running Serve app.

- concurrency sweep: TTFT, inter-token latency, throughput and goodput for disaggregated
  FP8, colocated FP8 and disaggregated BF16 KV (one KV memory budget for all);
- store-hit vs cold TTFT for a 2k-token shared prefix (two prefill replicas, forced apart);
- chunk transfer: publish / fetch time for Llama-3-8B-sized FP8 chunks, the store-owned put
  (the shard copies) against a plain producer-owned ray.put, and the integrity check's share
  as the engine pays it (bench/kv_transfer.py's same-pass measure: median and spread of the
  per-repeat shares, and the floor of hashing every byte at both ends on this machine).

    python bench/serve.py [--model PATH] [--quick] [--transfer-only]

Writes bench/results/serve.json and serve.png (--transfer-only: the chunk transfer alone,
bench/results/serve_chunk_transfer.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bar_plot, write_json  # noqa: E402

PORT = 8766
SLO_TTFT_S, SLO_ITL_S = 2.0, 0.25  # goodput counts requests meeting both


def bench_model(path: str | None) -> str:
    if path:
        return path
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from tiny_models import make_checkpoint

    return make_checkpoint(
        "llama", tempfile.mkdtemp(), hidden_size=256, head_dim=64, max_position_embeddings=4096
    )


def app_args(model: str, mode: str, kv: str, prefill_replicas: int = 1) -> dict:
    return {
        "mode": mode,
        "num_prefill_replicas": prefill_replicas,
        "engine": {
            "model": model,
            "dtype": "float32",
            "kv_cache_dtype": kv,
            "kv_cache_memory_bytes": 8 << 20,
            "chunk_tokens": 256,
            "torch_threads": 1,
        },
        "served_model_name": "bench",
        "allow_routing_hints": True,
        "max_ongoing_requests": 64,
        "max_queued_requests": 256,
    }


async def one_request(client, prompt, max_tokens, headers=None) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", "/v1/completions", json=body, headers=headers or {}) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"choices": [{' in line:
                stamps.append(time.perf_counter() - start)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "status": 200,
        "ttft": stamps[0],
        "itl": statistics.mean(gaps) if gaps else 0.0,
        "tokens": len(stamps),
        "e2e": stamps[-1],
    }


async def sweep(url: str, concurrency: list[int], requests_per_level: int, vocab: int) -> dict:
    import httpx

    out = {}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for c in concurrency:
            prompts = [
                [3 + (i * 31 + j * 7) % (vocab - 3) for j in range(128)]
                for i in range(requests_per_level)
            ]
            sem = asyncio.Semaphore(c)

            async def run(p, sem=sem):
                async with sem:
                    return await one_request(client, p, 32)

            t = time.perf_counter()
            results = await asyncio.gather(*(run(p) for p in prompts))
            wall = time.perf_counter() - t
            ok = [r for r in results if r["status"] == 200]
            good = [r for r in ok if r["ttft"] <= SLO_TTFT_S and r["itl"] <= SLO_ITL_S]
            out[str(c)] = {
                "requests": len(results),
                "ok": len(ok),
                "ttft_p50_s": statistics.median(r["ttft"] for r in ok),
                "ttft_p90_s": sorted(r["ttft"] for r in ok)[int(0.9 * (len(ok) - 1))],
                "itl_mean_s": statistics.mean(r["itl"] for r in ok),
                "throughput_tok_s": sum(r["tokens"] for r in ok) / wall,
                "goodput_tok_s": sum(r["tokens"] for r in good) / wall,
            }
            print(f"  concurrency {c}: {json.dumps(out[str(c)])}", flush=True)
    return out


async def store_hit_ttft(url: str, vocab: int, trials: int) -> dict:
    import httpx

    cold, hit = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for t in range(trials):
            prefix = [3 + (t * 101 + j * 13) % (vocab - 3) for j in range(2048)]
            r0 = {"x-slimserve-prefill-replica": "0"}
            r1 = {"x-slimserve-prefill-replica": "1"}
            cold.append((await one_request(client, prefix + [5, 6, 7], 4, r0))["ttft"])
            hit.append((await one_request(client, prefix + [8, 9, 10], 4, r1))["ttft"])
    ratio = statistics.median(hit) / statistics.median(cold)
    return {"cold_ttft_s": cold, "hit_ttft_s": hit, "hit_over_cold_median": ratio}


def chunk_transfer(num_chunks: int, repeats: int) -> dict:
    """Llama-3-8B-sized FP8 chunks (L=32, Hkv=8, D=128, 256 tokens): ~16.9 MB each. The
    store-owned publish against a plain producer-owned ray.put, and the integrity check as
    the engine pays it (bench/kv_transfer.py: the tag folded in the encode's copy, checked
    in the import's cache write, the same loads: copy_tag; without the C++ kernels, hashed
    after each copy: same_pass; shares within each repeat, median and spread, of encode +
    publish + fetch + import and of the same without the cache write). The check as a pass of
    its own at fetch (what a prefill replica's store hit still does) is beside it."""
    import numpy as np
    import ray
    import torch

    from app.kv.chunk import ChunkMeta, KVChunk
    from app.kv.chunk_format import ChunkFormat
    from app.kv.layout import KVLayout
    from app.kvstore.store import KVStoreClient, create_store
    from app.kvstore.transfer import fetch_verified, publish
    from bench import kv_transfer
    from slimserve_kernels import cpu_tag

    layout = str(KVLayout(32, 8, 128, 16))
    prompt = list(range(256 * num_chunks))
    chunks = []
    for i in range(num_chunks):
        ids = tuple(prompt[i * 256 : (i + 1) * 256])
        meta = ChunkMeta("bench", "fp8_e4m3", layout, ids, i * 256, bytes([i]) * 16)
        kv = torch.randn(32, 2, 256, 8, 128).to(torch.float8_e4m3fn)
        chunks.append(KVChunk.from_tensors(meta, kv, torch.zeros(32, 2, 256, 8, dtype=torch.int8)))
    client = KVStoreClient(create_store(4 << 30))
    ray.get(client.shards[0].stats.remote())  # actor start-up is not transfer time
    t = time.perf_counter()
    stored = asyncio.run(publish(client, chunks))
    publish_s = time.perf_counter() - t
    plain = [np.frombuffer(c.encode(), dtype=np.uint8) for c in chunks]
    t = time.perf_counter()
    refs = [ray.put(p) for p in plain]
    plain_put_s = time.perf_counter() - t
    expect = ChunkFormat.from_layout("bench", "fp8_e4m3", layout, 256)
    got = asyncio.run(fetch_verified(client, stored, expect, prompt))
    assert not got.failures
    del refs
    asyncio.run(kv_transfer.drop_all(client, stored))
    engine = kv_transfer.measure(client, num_chunks, repeats)
    ray.kill(client.shards[0])
    size = sum(s.size for s in stored)
    # The engine's mode on this CPU: the tag in the copy where the C++ kernels build
    mode = "copy_tag" if cpu_tag.available() else "same_pass"
    same_pass = engine["shares"][f"{mode}/thread"]
    per_repeat = engine["shares_per_repeat"]  # {median, p25, p75, min, max} per share
    return {
        "chunk_bytes": stored[0].size,
        "num_chunks": num_chunks,
        "publish_store_owned_s": publish_s,
        "plain_producer_owned_put_s": plain_put_s,
        "fetch_s": got.fetch_s,
        "publish_gb_s": size / publish_s / 1e9,
        "integrity_mode": mode,
        "integrity_s": same_pass["integrity_s"],
        "transfer_s": same_pass["transfer_s"],
        "integrity_share_of_transfer": same_pass["integrity_share"],  # from stage minimums
        # The headline: within each repeat, then median and spread (the mode, its thread)
        "integrity_share": per_repeat[f"{mode}/thread:integrity_share"],
        "integrity_share_without_cache_write": per_repeat[f"{mode}/thread:check_share"],
        "integrity_share_hash_calls": per_repeat["same_pass_hash_calls_share"],
        "integrity_share_overlapped_wall": per_repeat["overlapped/wall:integrity_share"],
        "integrity_floor_share": per_repeat["floor_share"],
        "integrity_shares_per_repeat": per_repeat,
        "load_average_1m": engine["load_average_1m"],
        "integrity_shares": engine["shares"],
        "engine_stage_min_s": engine["min_s"],
        "separate_pass_verify_s": got.verify_s,
        "separate_pass_share": got.verify_s / (publish_s + got.fetch_s + got.verify_s),
    }


def transfer_only(num_chunks: int, repeats: int) -> int:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        result = {"chunk_transfer": chunk_transfer(num_chunks, repeats)}
    finally:
        ray.shutdown()
    print(json.dumps({k: v for k, v in result["chunk_transfer"].items() if "shares" not in k}))
    print("->", write_json("serve_chunk_transfer", result))
    return 0


def kv_capacity_tokens(mode: str) -> int:
    """Tokens the decoding replica's KV budget holds (same bytes for FP8 and BF16)."""
    from ray import serve

    name = "EngineServer" if mode == "colocated" else "DecodeServer"
    stats = serve.get_deployment_handle(name, "bench").stats.remote().result()
    return int(stats["kv_blocks_total"]) * 16


def run_app(args: dict):
    from ray import serve

    from app.serve.build import build_app

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{PORT}"


def stop_app(args: dict) -> None:
    import ray
    from ray import serve

    from app.kvstore.store import KVStoreClient

    serve.delete("bench")
    if args["mode"] == "disaggregated":
        for shard in KVStoreClient.from_name("slimserve-kvstore", 1).shards:
            ray.kill(shard)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model")
    p.add_argument("--quick", action="store_true", help="fewer requests and trials")
    p.add_argument("--transfer-only", action="store_true", help="the chunk transfer alone")
    a = p.parse_args()
    if a.transfer_only:
        return transfer_only(*((4, 3) if a.quick else (8, 9)))
    import ray

    from app.config import ModelConfig

    model = bench_model(a.model)
    vocab = ModelConfig.from_path(model).vocab_size
    levels, per_level, trials = ([1, 4], 8, 3) if a.quick else ([1, 4, 8], 16, 5)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    results: dict = {"model": model, "slo": {"ttft_s": SLO_TTFT_S, "itl_s": SLO_ITL_S}}
    try:
        results["chunk_transfer"] = chunk_transfer(*((4, 3) if a.quick else (8, 5)))
        print("chunk transfer:", json.dumps(results["chunk_transfer"]), flush=True)
        sweeps = {}
        for name, mode, kv in [
            ("disagg-fp8", "disaggregated", "fp8_e4m3"),
            ("colocated-fp8", "colocated", "fp8_e4m3"),
            ("disagg-bf16", "disaggregated", "bf16"),
        ]:
            print(name, flush=True)
            args = app_args(model, mode, kv)
            url = run_app(args)
            sweeps[name] = {
                "kv_capacity_tokens": kv_capacity_tokens(mode),
                **asyncio.run(sweep(url, levels, per_level, vocab)),
            }
            stop_app(args)
        results["sweep"] = sweeps
        args = app_args(model, "disaggregated", "fp8_e4m3", prefill_replicas=2)
        url = run_app(args)
        results["store_hit_2k"] = asyncio.run(store_hit_ttft(url, vocab, trials))
        print("store hit:", json.dumps(results["store_hit_2k"]), flush=True)
        stop_app(args)
    finally:
        ray.shutdown()
    write_json("serve", results)
    ttft = {
        n: {c: v["ttft_p50_s"] for c, v in s.items() if c != "kv_capacity_tokens"}
        for n, s in results["sweep"].items()
    }
    bar_plot("serve", "TTFT p50 by concurrency", ttft, "seconds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
