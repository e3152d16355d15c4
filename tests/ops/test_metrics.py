"""app/serve/metrics.py without Ray: what each call records (Ray's metric objects faked)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest

from app.serve import metrics
from app.serve.metrics import SPECS, ReplicaMetrics, prometheus_name, ray_name
from app.serve.routing.autoscaling import DESIRED_REPLICAS_GAUGE, INPUT_GAUGE


class Recorder:
    def __init__(self):
        self.values: dict[tuple, list[float]] = defaultdict(list)

    def _key(self, tags):
        return tuple(sorted(tags.items()))

    def inc(self, value, tags):
        self.values[self._key(tags)].append(value)

    set = observe = inc


@pytest.fixture
def recorded(monkeypatch):
    recorders: dict[str, Recorder] = defaultdict(Recorder)
    monkeypatch.setattr(metrics, "_metric", lambda name: recorders[name])
    return recorders


def values(recorders, name, **tags):
    base = {"model": "m", "role": tags.pop("role", "prefill"), **tags}
    return recorders[name].values[tuple(sorted(base.items()))]


STATS = {
    "num_running": 3,
    "num_waiting": 1,
    "kv_blocks_total": 100,
    "kv_blocks_free": 60,
    "kv_cache_usage": 0.4,
    "prefix_cache_queries": 10,
    "prefix_cache_hits": 4,
    "prefix_cache_evictions": 0,
    "preemptions": 0,
}


def test_on_step_sets_gauges_and_turns_cumulative_counts_into_increments(recorded):
    m = ReplicaMetrics("prefill", "m")
    m.on_step(STATS, block_size=16)
    m.on_step({**STATS, "prefix_cache_queries": 15, "prefix_cache_hits": 4, "preemptions": 2}, 16)
    assert values(recorded, "slimserve:num_requests_running") == [3, 3]
    assert values(recorded, "slimserve:kv_cache_usage_perc") == [0.4, 0.4]
    assert values(recorded, "slimserve:kv_cache_blocks_used") == [40, 40]
    assert values(recorded, "slimserve:kv_cache_blocks_free") == [60, 60]
    # Blocks -> tokens (vLLM counts prefix cache queries and hits in tokens).
    assert values(recorded, "slimserve:prefix_cache_queries", cache="local") == [160, 80]
    assert values(recorded, "slimserve:prefix_cache_hits", cache="local") == [64]
    assert values(recorded, "slimserve:preemptions") == [2]
    m.on_step({**STATS, "prefix_cache_queries": 0}, 16)  # engine restarted: no negative inc
    assert values(recorded, "slimserve:prefix_cache_queries", cache="local") == [160, 80]


def test_store_and_chunk_metrics(recorded):
    m = ReplicaMetrics("decode", "m")
    m.on_store_lookup(512, 256)
    m.on_store_lookup(0, 0)
    m.on_chunks("fetch", 1000)
    m.on_chunks("publish", 0)
    m.on_chunk_failures([(b"k", "integrity", "bad tag"), (b"j", "fetch", "owner died")])
    assert values(recorded, "slimserve:prefix_cache_queries", role="decode", cache="store") == [512]
    assert values(recorded, "slimserve:prefix_cache_hits", role="decode", cache="store") == [256]
    moved = "slimserve:kv_chunk_bytes_transferred"
    assert values(recorded, moved, role="decode", direction="fetch") == [1000]
    assert values(recorded, moved, role="decode", direction="publish") == []
    failures = "slimserve:kv_integrity_failures"
    assert values(recorded, failures, role="decode", reason="integrity") == [1]
    assert values(recorded, failures, role="decode", reason="fetch") == [1]
    with pytest.raises(AssertionError):
        m.on_chunks("sideways", 1)


class Stream:
    """An engine-like delta stream that sleeps before each delta and records being closed."""

    def __init__(self, sizes, delay=0.01):
        self.sizes, self.delay, self.closed = sizes, delay, False

    async def gen(self):
        try:
            for n in self.sizes:
                await asyncio.sleep(self.delay)
                yield SimpleNamespace(new_token_ids=[0] * n)
        finally:
            self.closed = True


async def drain(agen, limit=None):
    out = []
    async for d in agen:
        out.append(d)
        if limit is not None and len(out) == limit:
            break
    await agen.aclose()
    return out


def test_timed_choice_at_the_ingress(recorded):
    m = ReplicaMetrics("ingress", "m")
    stream = Stream([1, 2, 0, 1])
    got = asyncio.run(drain(m.timed(stream.gen(), num_prompt_tokens=7)))
    assert len(got) == 4
    (ttft,) = values(recorded, "slimserve:time_to_first_token_seconds", role="ingress")
    itl = values(recorded, "slimserve:inter_token_latency_seconds", role="ingress")
    (e2e,) = values(recorded, "slimserve:e2e_request_latency_seconds", role="ingress")
    assert 0.005 < ttft < e2e
    assert len(itl) == 3 and all(0 < x < e2e for x in itl)  # a 2-token delta: 2 gaps
    assert sum(values(recorded, "slimserve:generation_tokens", role="ingress")) == 4
    assert values(recorded, "slimserve:prompt_tokens", role="ingress") == [7]


def test_a_first_delta_of_several_tokens_counts_a_gap_for_each_after_the_first(recorded):
    """Every token after a choice's first is one inter-token gap, also when the first delta
    brings several (deltas merged while the ingress lagged): those gaps are 0. Seen failing
    (2 gaps, not 4: the served metrics test's ITL count one short) with the first delta
    recording only its TTFT."""
    m = ReplicaMetrics("ingress", "m")
    asyncio.run(drain(m.timed(Stream([3, 2]).gen(), num_prompt_tokens=7)))
    itl = values(recorded, "slimserve:inter_token_latency_seconds", role="ingress")
    assert len(values(recorded, "slimserve:time_to_first_token_seconds", role="ingress")) == 1
    assert len(itl) == 4 and itl[:2] == [0.0, 0.0] and all(x > 0 for x in itl[2:])


def test_timed_replica_views_do_not_count_tokens(recorded):
    prefill, decode = ReplicaMetrics("prefill", "m"), ReplicaMetrics("decode", "m")
    asyncio.run(drain(prefill.timed(Stream([1]).gen(), 5, count=False)))
    asyncio.run(drain(decode.timed(Stream([1, 1]).gen(), 5, count=False, after_first_token=True)))
    assert len(values(recorded, "slimserve:time_to_first_token_seconds")) == 1
    assert values(recorded, "slimserve:time_to_first_token_seconds", role="decode") == []
    assert len(values(recorded, "slimserve:inter_token_latency_seconds", role="decode")) == 2
    for role in ("prefill", "decode"):
        assert values(recorded, "slimserve:generation_tokens", role=role) == []
        assert values(recorded, "slimserve:e2e_request_latency_seconds", role=role) == []


def test_a_choice_closed_early_closes_its_stream_and_counts(recorded):
    m = ReplicaMetrics("ingress", "m")
    stream = Stream([1, 1, 1, 1])
    got = asyncio.run(drain(m.timed(stream.gen(), 3), limit=2))  # e.g. a stop string
    assert len(got) == 2 and stream.closed  # the engine stream is closed at once (abort)
    assert len(values(recorded, "slimserve:e2e_request_latency_seconds", role="ingress")) == 1
    assert values(recorded, "slimserve:prompt_tokens", role="ingress") == [3]


def test_a_failed_or_cancelled_choice_records_no_e2e(recorded):
    async def failing():
        yield SimpleNamespace(new_token_ids=[1])
        raise RuntimeError("replica died")

    async def cancelled():
        m = ReplicaMetrics("ingress", "m")
        stream = Stream([1, 1, 1], delay=10)
        task = asyncio.ensure_future(drain(m.timed(stream.gen(), 3)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return stream

    m = ReplicaMetrics("ingress", "m")
    with pytest.raises(RuntimeError):
        asyncio.run(drain(m.timed(failing(), 3)))
    assert asyncio.run(cancelled()).closed
    assert values(recorded, "slimserve:e2e_request_latency_seconds", role="ingress") == []
    assert values(recorded, "slimserve:prompt_tokens", role="ingress") == []
    assert len(values(recorded, "slimserve:time_to_first_token_seconds", role="ingress")) == 1


def test_names_follow_vllm_and_ray_export_rules():
    assert set(SPECS) >= {
        "slimserve:time_to_first_token_seconds",
        "slimserve:inter_token_latency_seconds",
        "slimserve:e2e_request_latency_seconds",
        "slimserve:num_requests_running",
        "slimserve:num_requests_waiting",
        "slimserve:kv_cache_usage_perc",
        "slimserve:prefix_cache_queries",
        "slimserve:prefix_cache_hits",
        "slimserve:kv_chunk_bytes_transferred",
        "slimserve:kv_integrity_failures",
        "slimserve:preemptions",
        "slimserve:prompt_tokens",
        "slimserve:generation_tokens",
    }
    assert ray_name("slimserve:prompt_tokens") == "slimserve_prompt_tokens"
    assert prometheus_name("slimserve:prompt_tokens") == "ray_slimserve_prompt_tokens_total"
    assert prometheus_name("slimserve:kv_cache_usage_perc") == "ray_slimserve_kv_cache_usage_perc"
    for spec in SPECS.values():
        if spec.buckets:
            assert list(spec.buckets) == sorted(set(spec.buckets)) and spec.buckets[0] > 0
    with pytest.raises(AssertionError):
        ReplicaMetrics("router", "m")


def test_grafana_dashboard_charts_every_metric():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "deploy", "grafana", "slimserve.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set(re.findall(r"ray_slimserve_\w+", " ".join(exprs)))
    exported = {prometheus_name(n) for n in SPECS}
    exported |= {f"ray_{g}" for g in (DESIRED_REPLICAS_GAUGE, INPUT_GAUGE)}  # the controller's
    suffixes = ("_bucket", "_count", "_sum")
    used_names = {next((u[: -len(s)] for s in suffixes if u.endswith(s)), u) for u in used}
    assert used_names <= exported, used_names - exported  # no typos in the queries
    assert exported <= used_names, exported - used_names  # every metric has a panel
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
