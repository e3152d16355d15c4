"""TokenAwareRouter's policy on stand-in replicas (no cluster needed)."""

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from app.serve.messages import GenerateRequest, RoutingInfo
from app.serve.routing.router import TokenAwareRouter


@dataclass(frozen=True)
class FakeID:
    unique_id: str


@dataclass
class FakeReplica:
    name: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8

    @property
    def replica_id(self) -> FakeID:
        return FakeID(self.name)


def router(role="prefill") -> TokenAwareRouter:
    r = object.__new__(TokenAwareRouter)  # the policy only; Serve's plumbing is not needed
    r.initialize_state(role=role, chunk_tokens=32)
    r.select_available_replicas = lambda candidates: candidates
    return r


def pending(num_tokens, keys=(), hint=None, rid="r1"):
    req = GenerateRequest("x", [1] * num_tokens, None, routing=RoutingInfo(num_tokens, keys, hint))
    metadata = SimpleNamespace(internal_request_id=rid)
    context = SimpleNamespace(should_backoff=False)  # Serve's RequestRoutingContext
    return SimpleNamespace(args=[req], metadata=metadata, routing_context=context)


def choose(r, replicas, pr):
    return [group[0].name for group in asyncio.run(r.choose_replicas(replicas, pr))]


def test_least_pending_prefill_tokens_wins():
    busy = FakeReplica("a", {"inflight_tokens": 900, "free_blocks": 100})
    idle = FakeReplica("b", {"inflight_tokens": 100, "free_blocks": 100})
    assert choose(router(), [busy, idle], pending(200)) == ["b", "a"]


def test_prefix_affinity_wins_near_ties_but_not_against_big_imbalance():
    keys = (11, 22, 33, 44)  # 4 chunks = 128 tokens of prefix
    holder = FakeReplica("a", {"inflight_tokens": 150, "cached_keys": [11, 22, 33, 44]})
    other = FakeReplica("b", {"inflight_tokens": 100, "cached_keys": [11]})
    assert choose(router(), [holder, other], pending(200, keys))[0] == "a"
    holder.routing_stats["inflight_tokens"] = 1000
    assert choose(router(), [holder, other], pending(200, keys))[0] == "b"


def test_decode_balances_kv_tokens_held_and_avoids_full_replicas():
    full = FakeReplica("a", {"kv_tokens_held": 10, "free_blocks": 1, "block_size": 16})
    roomy = FakeReplica("b", {"kv_tokens_held": 5000, "free_blocks": 900, "block_size": 16})
    light = FakeReplica("c", {"kv_tokens_held": 300, "free_blocks": 900, "block_size": 16})
    assert choose(router("decode"), [full, roomy, light], pending(100)) == ["c", "b", "a"]


def test_tokens_sent_between_stats_reports_count():
    r = router()
    a, b = FakeReplica("a"), FakeReplica("b")
    first = pending(500, rid="r1")
    assert choose(r, [a, b], first)[0] == "a"  # tie: stable order
    r.on_request_routed(first, a.replica_id, None)
    assert choose(r, [a, b], pending(500, rid="r2"))[0] == "b"
    r.on_request_completed(a.replica_id, "r1")
    assert choose(r, [a, b], pending(500, rid="r3"))[0] == "a"


def test_hint_forces_a_replica_by_index():
    replicas = [FakeReplica("b"), FakeReplica("a"), FakeReplica("c")]
    assert choose(router(), replicas, pending(10, hint=0)) == ["a"]
    assert choose(router(), replicas, pending(10, hint=4)) == ["b"]
