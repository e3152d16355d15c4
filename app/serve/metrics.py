"""slimserve's Prometheus metrics, exported through Ray's metrics agent (``ray.serve.metrics``).

Names follow vLLM's where the concept is the same (``vllm:time_to_first_token_seconds`` ->
``slimserve:time_to_first_token_seconds``) so dashboards and alerts port over. Ray refuses
':' in new metric names, so each is registered with ':' -> '_' (vLLM does the same on Ray),
and Ray's exporter prefixes ``ray_``; counters get Prometheus' ``_total`` suffix. So
``slimserve:prompt_tokens`` is scraped as ``ray_slimserve_prompt_tokens_total``
(``prometheus_name`` spells it; docs/operations.md lists them all).

Every series carries ``model`` and ``role`` (``ingress`` for the client's view of a request,
``prefill``, ``decode`` or ``colocated`` for a replica), plus Serve's own ``application``,
``deployment`` and ``replica`` tags. Units follow vLLM: prefix cache queries and hits count
tokens; bytes are bytes; latencies are seconds.

Usage: a deployment holds one ``ReplicaMetrics(role, model)`` and calls ``on_step`` with
``Engine.stats()`` (cumulative counters become increments), ``on_store_lookup`` /
``on_chunks`` / ``on_chunk_failures`` around the KV store, and wraps each choice's delta
stream in ``timed(...)`` for TTFT, inter-token and end-to-end latency and token counts.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray.serve import metrics as serve_metrics

ROLES = ("ingress", "prefill", "decode", "colocated")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS += (7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
ITL_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
E2E_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    kind: str  # "counter" | "gauge" | "histogram"
    description: str
    tags: tuple[str, ...] = ()  # beyond model and role
    buckets: tuple[float, ...] | None = None


SPECS: dict[str, MetricSpec] = {
    "slimserve:time_to_first_token_seconds": MetricSpec(
        "histogram", "Time from arrival to the first generated token.", buckets=TTFT_BUCKETS
    ),
    "slimserve:inter_token_latency_seconds": MetricSpec(
        "histogram", "Time between consecutive generated tokens.", buckets=ITL_BUCKETS
    ),
    "slimserve:e2e_request_latency_seconds": MetricSpec(
        "histogram", "Time from arrival to the last token of a choice.", buckets=E2E_BUCKETS
    ),
    "slimserve:num_requests_running": MetricSpec("gauge", "Sequences in the engine's batch."),
    "slimserve:num_requests_waiting": MetricSpec("gauge", "Sequences waiting to be scheduled."),
    "slimserve:kv_cache_usage_perc": MetricSpec("gauge", "KV cache usage, 1 = full."),
    "slimserve:kv_cache_blocks_used": MetricSpec("gauge", "KV cache blocks in use."),
    "slimserve:kv_cache_blocks_free": MetricSpec("gauge", "KV cache blocks free or cached."),
    "slimserve:prefix_cache_queries": MetricSpec(
        "counter", "Prompt tokens looked up in a prefix cache (cache=local|store).", ("cache",)
    ),
    "slimserve:prefix_cache_hits": MetricSpec(
        "counter", "Prompt tokens found in a prefix cache (cache=local|store).", ("cache",)
    ),
    "slimserve:kv_chunk_bytes_transferred": MetricSpec(
        "counter", "KV chunk bytes moved via the store (direction=publish|fetch).", ("direction",)
    ),
    "slimserve:kv_integrity_failures": MetricSpec(
        "counter", "KV chunks dropped after a failed check (reason=integrity|fetch).", ("reason",)
    ),
    "slimserve:kv_export_failures": MetricSpec(
        "counter", "Prefills whose KV export failed (the decode replica recomputed the prompt)."
    ),
    "slimserve:preemptions": MetricSpec("counter", "Sequences preempted for lack of KV blocks."),
    "slimserve:prefill_placements": MetricSpec(
        "counter",
        "Prefill placement decisions (app/serve/routing/prefill_placement.py), by where and why.",
        tags=("where", "reason"),
    ),
    "slimserve:prefill_queue_tokens": MetricSpec(
        "gauge", "Prompt tokens still to prefill on this prefill replica (a placement input)."
    ),
    "slimserve:decode_headroom_tokens": MetricSpec(
        "gauge", "Free KV tokens less queued local prefills on this decode replica (placement)."
    ),
    "slimserve:prefill_shares_compute": MetricSpec(
        "gauge", "1 when the least-loaded prefill replica runs on its decode replica's compute."
    ),
    "slimserve:prefill_rate_tokens_per_second": MetricSpec(
        "gauge", "Prompt tokens/s of this replica's prefill steps, measured (0: none yet)."
    ),
    "slimserve:decode_step_seconds": MetricSpec(
        "gauge", "Wall time of this replica's decode-only steps, moving average (0: none yet)."
    ),
    "slimserve:prefill_placement_ttft_estimate_seconds": MetricSpec(
        "histogram",
        "The placement policy's TTFT estimate for the side it chose (where=local|remote).",
        tags=("where",),
        buckets=TTFT_BUCKETS,
    ),
    "slimserve:local_prefills": MetricSpec(
        "counter", "Choices given to their decode replica to prefill (a prompt under a KV chunk)."
    ),
    # Speculative decoding (vLLM's spec_decode names): acceptance rate = accepted / draft
    # tokens; mean accepted length (tokens per target forward) = 1 + accepted / drafts.
    "slimserve:spec_decode_num_drafts": MetricSpec(
        "counter", "Sequence-steps that verified at least one proposed token."
    ),
    "slimserve:spec_decode_num_draft_tokens": MetricSpec("counter", "Proposed tokens verified."),
    "slimserve:spec_decode_num_accepted_tokens": MetricSpec(
        "counter", "Proposed tokens accepted by verification."
    ),
    # The cost policy (app/engine/spec/cost.py): speculation paused while a verify step costs
    # more wall time per emitted token than a plain decode step. Share of decode steps
    # paused = rate(..._paused_steps) / steps; on replicas with `cost_aware` on only.
    "slimserve:spec_decode_cost_paused_steps": MetricSpec(
        "counter", "Decode steps in which the cost policy held speculation back."
    ),
    "slimserve:spec_decode_cost_pauses": MetricSpec(
        "counter", "Times the cost policy paused speculation (after learning or a re-probe)."
    ),
    "slimserve:spec_decode_cost_resumes": MetricSpec(
        "counter", "Times the cost policy resumed speculation (a re-probe found it pays)."
    ),
    "slimserve:spec_decode_cost_probes": MetricSpec(
        "counter", "Re-probes of the kind of step the cost policy was not choosing."
    ),
    "slimserve:spec_decode_cost_probe_steps": MetricSpec(
        "counter", "Decode steps the cost policy spent (re)learning a kind's cost."
    ),
    "slimserve:spec_decode_cost_ratio": MetricSpec(
        "gauge", "Verify over plain decode step seconds per emitted token (0: not measured)."
    ),
    "slimserve:prompt_tokens": MetricSpec("counter", "Prompt tokens of completed choices."),
    "slimserve:generation_tokens": MetricSpec("counter", "Generated tokens."),
}

_BASE_TAGS = ("model", "role")
_SPEC_COUNTERS = (  # metric <- Engine.stats() key
    ("slimserve:spec_decode_num_drafts", "spec_verify_steps"),
    ("slimserve:spec_decode_num_draft_tokens", "spec_proposed_tokens"),
    ("slimserve:spec_decode_num_accepted_tokens", "spec_accepted_tokens"),
    ("slimserve:spec_decode_cost_paused_steps", "spec_cost_paused_steps"),
    ("slimserve:spec_decode_cost_pauses", "spec_cost_pauses"),
    ("slimserve:spec_decode_cost_resumes", "spec_cost_resumes"),
    ("slimserve:spec_decode_cost_probes", "spec_cost_probes"),
    ("slimserve:spec_decode_cost_probe_steps", "spec_cost_probe_steps"),
)
# Exported only by replicas whose engine runs the cost policy (speculative_config with
# backoff and cost_aware on, the default), like the spec_decode_* counters only by
# replicas that speculate; the counters, as every counter, after their first increment.
COST_POLICY_METRICS = (
    "slimserve:spec_decode_cost_paused_steps",
    "slimserve:spec_decode_cost_pauses",
    "slimserve:spec_decode_cost_resumes",
    "slimserve:spec_decode_cost_probes",
    "slimserve:spec_decode_cost_probe_steps",
    "slimserve:spec_decode_cost_ratio",
)
_registry: dict[str, Any] = {}  # one Ray metric object per name per process


def ray_name(name: str) -> str:
    """The name Ray registers (':' is no longer allowed by ray.util.metrics)."""
    return name.replace(":", "_")


def prometheus_name(name: str) -> str:
    """The name a Prometheus scrape of Ray's metrics endpoint shows (histograms add
    ``_bucket``/``_sum``/``_count`` to it)."""
    suffix = "_total" if SPECS[name].kind == "counter" else ""
    return "ray_" + ray_name(name) + suffix


def _metric(name: str):
    if name not in _registry:
        spec = SPECS[name]
        tags = _BASE_TAGS + spec.tags
        if spec.kind == "histogram":
            buckets = list(spec.buckets or ())
            m = serve_metrics.Histogram(ray_name(name), spec.description, buckets, tags)
        elif spec.kind == "gauge":
            m = serve_metrics.Gauge(ray_name(name), spec.description, tags)
        else:
            m = serve_metrics.Counter(ray_name(name), spec.description, tags)
        _registry[name] = m
    return _registry[name]


def model_label(served_model_name: str | None, model_path: str) -> str:
    """The ``model`` label: what clients call the model (same rule as the ingress)."""
    return served_model_name or os.path.basename(model_path.rstrip("/"))


class ReplicaMetrics:
    """The metrics one Serve replica (or the ingress) records, with its model and role."""

    def __init__(self, role: str, model: str):
        assert role in ROLES, role
        self.tags = {"model": model, "role": role}
        self._last: dict[str, float] = {}  # cumulative engine counters at the previous step

    # --- engine state -----------------------------------------------------------
    def on_step(self, stats: dict[str, Any], block_size: int = 1) -> None:
        """Gauges from ``Engine.stats()``; its cumulative counters become increments
        (prefix cache blocks are counted as tokens: x ``block_size``)."""
        _metric("slimserve:num_requests_running").set(stats["num_running"], self.tags)
        _metric("slimserve:num_requests_waiting").set(stats["num_waiting"], self.tags)
        _metric("slimserve:kv_cache_usage_perc").set(stats["kv_cache_usage"], self.tags)
        free = stats["kv_blocks_free"]
        _metric("slimserve:kv_cache_blocks_free").set(free, self.tags)
        _metric("slimserve:kv_cache_blocks_used").set(stats["kv_blocks_total"] - free, self.tags)
        local = {**self.tags, "cache": "local"}
        blocks = ("slimserve:prefix_cache_queries", "prefix_cache_queries")
        self._count(*blocks, stats, block_size, local)
        self._count("slimserve:prefix_cache_hits", "prefix_cache_hits", stats, block_size, local)
        self._count("slimserve:preemptions", "preemptions", stats, 1, self.tags)
        for name, key in _SPEC_COUNTERS:
            if key in stats:  # only engines that speculate (cost policy: with it on) report these
                self._count(name, key, stats, 1, self.tags)
        if "spec_cost_ratio" in stats:
            _metric("slimserve:spec_decode_cost_ratio").set(stats["spec_cost_ratio"], self.tags)

    def _count(self, name: str, key: str, stats: dict, scale: int, tags: dict) -> None:
        value = float(stats[key])
        delta = value - self._last.get(key, 0.0)
        self._last[key] = value
        if delta > 0:  # a restarted engine starts from 0 again: skip, never go negative
            _metric(name).inc(delta * scale, tags)

    # --- KV store ---------------------------------------------------------------
    def on_store_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        tags = {**self.tags, "cache": "store"}
        if query_tokens > 0:
            _metric("slimserve:prefix_cache_queries").inc(query_tokens, tags)
        if hit_tokens > 0:
            _metric("slimserve:prefix_cache_hits").inc(hit_tokens, tags)

    def on_chunks(self, direction: str, num_bytes: int) -> None:
        assert direction in ("publish", "fetch"), direction
        if num_bytes > 0:
            tags = {**self.tags, "direction": direction}
            _metric("slimserve:kv_chunk_bytes_transferred").inc(num_bytes, tags)

    def on_chunk_failures(self, failures: list[tuple[Any, str, str]]) -> None:
        """``FetchResult.failures``: (key, reason, message) per dropped chunk."""
        for _, reason, _ in failures:
            _metric("slimserve:kv_integrity_failures").inc(1, {**self.tags, "reason": reason})

    # --- requests -----------------------------------------------------------------
    async def timed(
        self,
        deltas: AsyncIterator[Any],
        num_prompt_tokens: int,
        *,
        count: bool = True,
        after_first_token: bool = False,
    ) -> AsyncIterator[Any]:
        """Pass one choice's ``deltas`` (objects with ``new_token_ids``) through, timing them.

        ``count``: also record end-to-end latency and prompt/generation tokens (the ingress
        does; replicas that see only one phase don't, so sums over roles don't double).
        ``after_first_token``: the first token was produced elsewhere (decode after prefill):
        every token seen here is an inter-token gap, the first measured from the call.
        """
        timer = RequestTimer(self, num_prompt_tokens, count, after_first_token)
        ended = False  # normally, or closed by our consumer; not on an error or a cancel
        try:
            async for delta in deltas:
                timer.on_tokens(len(delta.new_token_ids))
                yield delta
            ended = True
        except GeneratorExit:  # the consumer had all it needed (final delta, stop string)
            ended = True
            raise
        finally:
            timer.finish(completed=ended)
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:  # closing us closes the engine stream now (abort, free KV)
                await aclose()

    def observe(self, name: str, value: float, **tags: str) -> None:
        """``tags``: the values of the metric's own tags (MetricSpec.tags)."""
        _metric(name).observe(value, {**self.tags, **tags})

    def inc(self, name: str, value: float, **tags: str) -> None:
        """``tags``: the values of the metric's own tags (MetricSpec.tags)."""
        if value > 0:
            _metric(name).inc(value, {**self.tags, **tags})

    def set(self, name: str, value: float) -> None:
        _metric(name).set(value, self.tags)


class RequestTimer:
    """TTFT, inter-token and end-to-end latency and token counts of one choice."""

    def __init__(
        self, metrics: ReplicaMetrics, num_prompt_tokens: int, count: bool, after_first: bool
    ):
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.count = count
        self.arrival = time.perf_counter()
        self.last: float | None = self.arrival if after_first else None  # latest token's time

    def restart(self) -> None:
        """The choice's clock starts now: a decode call placed with its prefill (the
        overlapped hand-off) waited for the prefill's result, which is not an inter-token
        gap of its own."""
        self.arrival = time.perf_counter()
        if self.last is not None:
            self.last = self.arrival

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.observe("slimserve:time_to_first_token_seconds", now - self.arrival)
            # Tokens that came with the first (deltas merged while the reader lagged) are
            # gaps of 0: every token after a choice's first is one inter-token gap.
            for _ in range(n - 1):
                self.metrics.observe("slimserve:inter_token_latency_seconds", 0.0)
        else:  # a delta of n tokens: n gaps of (elapsed / n)
            for _ in range(n):
                self.metrics.observe("slimserve:inter_token_latency_seconds", (now - self.last) / n)
        self.last = now
        if self.count:
            self.metrics.inc("slimserve:generation_tokens", n)

    def finish(self, completed: bool = True) -> None:
        """End of the choice; a failed or cancelled one records no e2e latency."""
        if self.count and completed and self.last is not None:
            self.metrics.observe("slimserve:e2e_request_latency_seconds", self.last - self.arrival)
            self.metrics.inc("slimserve:prompt_tokens", self.num_prompt_tokens)
