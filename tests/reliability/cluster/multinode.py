"""Multi-node scenario on a local ``ray.cluster_utils.Cluster`` (several raylets on this
machine), run in its own process: it needs its own Ray, and a test session has one.

Layout: two store shards on nodes S0 and S1, a producer engine (prefill's part: compute,
export, publish) on node P and a reader engine (a store hit as a replica takes it: look up,
fetch and verify, import, generate) on node R. Round 1 publishes every prompt's chunks;
round 2 reads them all while node S0 is removed (its shard, and every chunk object it
owned, are gone). Each round-2 answer must equal the reference (an Engine outside Ray), or
fail with a retriable Ray error; round 3 runs every prompt again after the loss.

    python -m reliability.cluster.multinode MODEL_PATH OUT.json
"""

from __future__ import annotations

import asyncio
import sys

import ray
from ray.cluster_utils import Cluster
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from app.kvstore.store import STORE_NAMESPACE, KVStoreActor, KVStoreClient
from reliability.cluster.runner import run_scenario

STORE, SHARDS, CAPACITY = "rel-multinode-kv", 2, 32 << 20
PROMPTS, CHUNK, MAX_TOKENS = 12, 32, 48


def engine(model: str):
    from app.config import CacheConfig, EngineConfig
    from app.engine.engine import Engine

    cache = CacheConfig(
        block_size=16, kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=4 << 20, chunk_tokens=CHUNK
    )
    return Engine(EngineConfig(model=model, dtype="float32", device="cpu", cache=cache))


def run(eng, request) -> list:
    eng.add_request(request)
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    return deltas


def params():
    from app.engine.sampling_params import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Replica:
    """An engine on one node with a store client (recreates dead shards, as replicas do)."""

    def __init__(self, model: str):
        import torch

        torch.set_num_threads(1)
        self.engine = engine(model)
        self.store = KVStoreClient.from_name(STORE, SHARDS, CAPACITY)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def publish(self, rid: str, prompt: list[int]) -> int:
        from app.engine.request import Request
        from app.kvstore.transfer import publish

        _, done = run(self.engine, Request(rid, prompt, params(), prefill_only=True))
        full = [c for c in done.exported_chunks if c.meta.num_tokens == CHUNK]
        return len(asyncio.run(publish(self.store, full)))

    def read(self, rid: str, prompt: list[int], keys: list[bytes]) -> dict:
        from app.engine.request import Request
        from app.kvstore.transfer import fetch_verified

        expect = self.engine.chunk_format
        hit = asyncio.run(self.store.match_prefix(keys))
        got = asyncio.run(fetch_verified(self.store, hit, expect, prompt, timeout_s=20))
        req = Request(rid, prompt, params(), kv_import=got.chunks or None)
        out = run(self.engine, req)
        return {
            "tokens": [t for d in out for t in d.new_token_ids],
            "cached": out[0].num_cached_tokens,
            "failures": [r for _, r, _ in got.failures],
            "free": self.engine.blocks.num_free == self.engine.blocks.num_blocks,
        }

    def keys(self, rid: str, prompt: list[int]) -> list[bytes]:
        from app.engine.request import Request

        _, done = run(self.engine, Request(rid, prompt, params(), prefill_only=True))
        return [c.key for c in done.exported_chunks if c.meta.num_tokens == CHUNK]

    def store_stats(self) -> dict:
        return asyncio.run(self.store.stats())


ReplicaActor = ray.remote(num_cpus=0)(Replica)


def on(node_id: str) -> dict:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}


def prompts() -> list[list[int]]:
    return [[3 + (s * 37 + i * 11) % 290 for i in range(3 * CHUNK + 5)] for s in range(PROMPTS)]


def place(cluster: Cluster, model: str):
    """Four nodes -> (nodes, shards pinned to S0/S1, producer on P, reader on R)."""
    names = ("S0", "S1", "P", "R")
    nodes = {n: cluster.add_node(num_cpus=1, object_store_memory=80 << 20) for n in names}
    cluster.wait_for_nodes()
    ids = {n: node.node_id for n, node in nodes.items()}
    shards = [
        KVStoreActor.options(
            name=f"{STORE}-{i}", namespace=STORE_NAMESPACE, lifetime="detached", max_restarts=-1,
            **on(ids[f"S{i}"]),
        ).remote(CAPACITY // SHARDS, i)
        for i in range(SHARDS)
    ]  # fmt: skip
    producer = ReplicaActor.options(**on(ids["P"])).remote(model)
    reader = ReplicaActor.options(**on(ids["R"])).remote(model)
    assert ray.get(producer.node.remote()) == ids["P"] and ray.get(reader.node.remote()) == ids["R"]
    return nodes, shards, producer, reader


def outcomes(refs: list) -> list[dict]:
    """Each read's result, or the retriable Ray error it ended with."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=300))
        except (RayActorError, ray.exceptions.GetTimeoutError) as e:
            out.append({"error": type(e).__name__})
    return out


def scenario(model: str, cluster: Cluster) -> dict:
    nodes, _, producer, reader = place(cluster, model)
    batch = prompts()
    wants = reference(model, batch)
    keys = ray.get([producer.keys.remote(f"k{i}", p) for i, p in enumerate(batch)])
    published = ray.get([producer.publish.remote(f"p{i}", p) for i, p in enumerate(batch)])
    before = ray.get(reader.store_stats.remote())

    pending = [reader.read.remote(f"r{i}", p, keys[i]) for i, p in enumerate(batch)]
    done_before_loss = len(ray.wait(pending, num_returns=PROMPTS // 3)[0])
    cluster.remove_node(nodes["S0"])  # shard 0 and every chunk object it owned
    round2 = outcomes(pending)

    again = ray.get([reader.read.remote(f"a{i}", p, keys[i]) for i, p in enumerate(batch)])
    republished = ray.get([producer.publish.remote(f"q{i}", p) for i, p in enumerate(batch)])
    fresh = ReplicaActor.options(**on(nodes["P"].node_id)).remote(model)  # an empty cache
    third = ray.get([fresh.read.remote(f"f{i}", p, keys[i]) for i, p in enumerate(batch)])
    after = ray.get(fresh.store_stats.remote())
    return {
        "nodes": len(nodes) + 1,
        "prompts": PROMPTS,
        "chunks_published": sum(published),
        "chunks_on_lost_shard": sum(shard_of(k) == 0 for ks in keys for k in ks),
        "done_before_loss": done_before_loss,
        "store_before": before,
        "store_after": after,
        "round2": tally(round2, wants),
        "round2_store_tokens": [o.get("cached") for o in round2],
        "round3_same_reader": tally(again, wants),
        "round3_republished": sum(republished),
        "round3_fresh_reader": tally(third, wants),
        "round3_fresh_store_tokens": [o["cached"] for o in third],
    }


def reference(model: str, batch: list[list[int]]) -> list[list[int]]:
    """The tokens of an undisturbed run: an Engine in this process, no Ray, no store."""
    ref = engine(model)
    outs = [run(ref, req(f"w{i}", p)) for i, p in enumerate(batch)]
    return [[t for d in out for t in d.new_token_ids] for out in outs]


def shard_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little") % SHARDS


def req(rid, prompt):
    from app.engine.request import Request

    return Request(rid, prompt, params())


def tally(outcomes: list[dict], wants: list[list[int]]) -> dict:
    out = {"correct": 0, "clean_error": 0, "wrong": 0, "blocks_held": 0}
    for o, want in zip(outcomes, wants):
        if "error" in o:
            out["clean_error"] += 1
            continue
        out["correct" if o["tokens"] == want else "wrong"] += 1
        out["blocks_held"] += not o["free"]
    return out


def main(model: str, out_path: str) -> None:
    run_scenario(scenario, model, out_path, {"num_cpus": 0})


if __name__ == "__main__":
    main(*sys.argv[1:3])
