"""Custom Serve autoscaling policies: prefill scales on prompt tokens, decode on KV and seqs.

Ray Serve's default policy sizes a deployment on ``target_ongoing_requests`` (requests per
replica). That fits neither phase of an LLM: one 8k-token prompt costs a prefill replica as
much as a hundred 80-token prompts, and a decode replica is full when its KV cache is full,
whatever the request count. So each engine replica reports its own load through Serve's
``record_autoscaling_stats`` hook (see ``autoscaling_stats``), Serve aggregates each metric per
replica over ``look_back_period_s`` with ``aggregation_function``, and the policies below turn
the totals into a replica count. Serve then applies ``upscaling_factor`` /
``downscaling_factor``, ``upscale_delay_s`` / ``downscale_delay_s`` and the
``min_replicas``/``max_replicas`` bounds, exactly as for its own policy.

Both are classes so the deploy config can tune them (``policy.policy_kwargs``); Serve builds
one instance per deployment and calls it every control-loop tick. Until the replicas have
reported (first seconds after start) they fall back to Serve's request-count policy.

Each decision is made visible to an operator (``DecisionReport``): a line in Serve's
controller log (the policies run in the controller; the Ray dashboard's Serve page links to
that log) whenever the wanted replica count or what drove it changes, and two gauges,
``slimserve:autoscaling_desired_replicas`` and ``slimserve:autoscaling_input``, every tick.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingContext
from ray.util.metrics import Gauge

# Serve's controller writes this logger to its log file (logs/serve/controller_*.log).
logger = logging.getLogger("ray.serve")

# Metric names a replica reports (record_autoscaling_stats) and the policies read.
PREFILL_TOKENS = "prefill_tokens"  # prompt tokens admitted and not yet prefilled
NUM_REQUESTS = "num_requests"  # sequences in the replica's engine (running + waiting)
KV_CACHE_USAGE = "kv_cache_usage"  # fraction of KV blocks in use, 0..1
NUM_RUNNING = "num_running"  # sequences in the decode batch
NUM_WAITING = "num_waiting"  # sequences admitted but not scheduled (no KV room / batch full)
# prompt tokens prefilled on decode replicas only because the prefill replicas were busy,
# as the ingresses last told this prefill replica (the same total to each: `SpilledDemand`)
SPILLED_PREFILL_TOKENS = "spilled_prefill_tokens"
SPILLED_TTL_PERIODS, SPILLED_TTL_MIN_S = 4, 5.0  # how long a told value counts (SpilledDemand)

# The policies' own gauges (Serve's controller sets them; charted in deploy/grafana)
DESIRED_REPLICAS_GAUGE = "slimserve_autoscaling_desired_replicas"
INPUT_GAUGE = "slimserve_autoscaling_input"


def autoscaling_stats(
    stats: dict[str, Any], inflight_tokens: int, spilled_tokens: int = 0
) -> dict[str, float]:
    """What an engine replica reports to the Serve autoscaler: ``Engine.stats()``, the
    prompt tokens of the requests it is working on (``EngineHost.inflight_tokens``) and, on
    a prefill replica, the prefill demand spilled to decode replicas."""
    return {
        PREFILL_TOKENS: float(inflight_tokens),
        SPILLED_PREFILL_TOKENS: float(spilled_tokens),
        NUM_REQUESTS: float(stats["num_running"] + stats["num_waiting"]),
        KV_CACHE_USAGE: float(stats["kv_cache_usage"]),
        NUM_RUNNING: float(stats["num_running"]),
        NUM_WAITING: float(stats["num_waiting"]),
    }


class SpilledDemand:
    """The prefill demand a prefill replica is told of by the ingresses: prompt tokens that
    prefill on decode replicas only because the prefill replicas' queue was long (an idle
    one would have taken them: `prefill_placement.spilled_tokens`). Each ingress sums the
    decode replicas' reports every routing period and tells every prefill replica the
    total; all ingresses see the same total, so the latest told wins (no sum). Unrefreshed
    for ``ttl_s`` (the ingresses stopped), it counts 0."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        assert ttl_s > 0
        self.ttl_s, self.clock = ttl_s, clock
        self._tokens, self._at = 0, -math.inf

    @classmethod
    def for_period(cls, routing_period_s: float) -> SpilledDemand:
        """Kept for SPILLED_TTL_PERIODS of the ingresses' routing period, and at least
        SPILLED_TTL_MIN_S: missed tells (polls slow down under the load that spills) keep
        it, ingresses gone for longer drop it."""
        return cls(max(SPILLED_TTL_MIN_S, SPILLED_TTL_PERIODS * routing_period_s))

    def tell(self, tokens: int) -> None:
        self._tokens, self._at = max(0, int(tokens)), self.clock()

    @property
    def tokens(self) -> int:
        return self._tokens if self.clock() - self._at <= self.ttl_s else 0


def _per_replica(ctx: AutoscalingContext, name: str) -> list[float] | None:
    """The metric's aggregated value for every running replica, or None if any is missing."""
    values = _reported(ctx, name)
    return values if values and len(values) == len(ctx.running_replicas) else None


def _reported(ctx: AutoscalingContext, name: str) -> list[float]:
    """The metric's aggregated value for the running replicas that report it (a replica of
    an older version may not)."""
    by_replica = (ctx.aggregated_metrics or {}).get(name) or {}
    values = (by_replica.get(r) for r in ctx.running_replicas)
    return [float(v) for v in values if v is not None and not math.isnan(v)]


class DecisionReport:
    """One policy's last decision, told to the controller log and to two gauges.

    Ray refuses ':' in metric names, so they are registered with '_' and scraped as
    ``ray_slimserve_autoscaling_desired_replicas`` / ``ray_slimserve_autoscaling_input``
    (docs/operations.md). The log line is written when ``ceil(desired)`` or the basis
    changes, not every tick (the control loop runs ten times a second)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.last: tuple[int, str] | None = None
        tags = ("application", "deployment")
        self.desired_gauge = Gauge(
            DESIRED_REPLICAS_GAUGE,
            "Replicas the slimserve policy wants, before Serve's bounds, factors and delays.",
            tag_keys=tags,
        )
        self.input_gauge = Gauge(
            INPUT_GAUGE,
            "What the slimserve policy's last decision was computed from (input=name).",
            tag_keys=(*tags, "input"),
        )

    def __call__(
        self, ctx: AutoscalingContext, desired: float, basis: str, inputs: dict[str, float]
    ) -> None:
        tags = {"application": ctx.app_name, "deployment": ctx.deployment_name}
        self.desired_gauge.set(float(desired), tags=tags)
        # Serve's own count of the requests running on the replicas (every engine call is a
        # Serve handle call), per replica: what an operator compares with the engines'
        inputs = {**inputs, "serve_running_requests_per_replica": serve_running_per_replica(ctx)}
        for name, value in inputs.items():
            self.input_gauge.set(float(value), tags={**tags, "input": name})
        key = (math.ceil(desired), basis)
        if key == self.last:
            return
        self.last = key
        logger.info(decision_line(ctx, self.policy, desired, basis, inputs))


def serve_running_per_replica(ctx: AutoscalingContext) -> float:
    return float(ctx.total_running_requests) / max(1, len(ctx.running_replicas))


def decision_line(
    ctx: AutoscalingContext, policy: str, desired: float, basis: str, inputs: dict[str, float]
) -> str:
    """``slimserve autoscaling: <deployment> wants <n> replicas ...``: what an operator greps
    the controller log for."""
    shown = " ".join(f"{k}={v:.4g}" for k, v in inputs.items())
    return (
        f"slimserve autoscaling: {ctx.deployment_name} ({ctx.app_name}) wants "
        f"{math.ceil(desired)} replicas (raw {desired:.3f}; running "
        f"{ctx.current_num_replicas}, target {ctx.target_num_replicas}, bounds "
        f"{ctx.capacity_adjusted_min_replicas}..{ctx.capacity_adjusted_max_replicas}) "
        f"by {basis} [{policy}] {shown}"
    )


def _fallback(ctx: AutoscalingContext, report: DecisionReport) -> tuple[float, dict[str, Any]]:
    """Serve's request-count policy, reported as such (the replicas have not reported yet)."""
    desired, state = replica_queue_length_autoscaling_policy(ctx)
    total = float(ctx.total_num_requests or 0.0)
    report(ctx, desired, "request_count", {"total_requests": total})
    return desired, state


class PrefillTokenPolicy:
    """Replicas = prompt tokens waiting to be prefilled / ``target_tokens_per_replica``.

    The waiting tokens are those the replicas hold (``prefill_tokens``), those that prefill
    on decode replicas only because this deployment's queue was long
    (``spilled_prefill_tokens``; every replica is told the same total, so the largest
    report counts: the placement policy's spill is demand for more prefill replicas, not
    less), plus an estimate for the requests Serve still queues at the callers' handles
    (beyond ``max_ongoing_requests``): each counted at the replicas' mean tokens per
    request, or ``default_prompt_tokens`` when the replicas are idle. Choose the target as
    the tokens one replica prefills within your TTFT budget (prefill throughput in
    tokens/s x budget in s).
    """

    def __init__(self, target_tokens_per_replica: float = 8192, default_prompt_tokens: int = 512):
        assert target_tokens_per_replica > 0 and default_prompt_tokens > 0
        self.target_tokens_per_replica = float(target_tokens_per_replica)
        self.default_prompt_tokens = default_prompt_tokens
        self.report = DecisionReport(type(self).__name__)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        tokens = _per_replica(ctx, PREFILL_TOKENS)
        requests = _per_replica(ctx, NUM_REQUESTS)
        if tokens is None or requests is None:
            return _fallback(ctx, self.report)
        held, running = sum(tokens), sum(requests)
        spilled = max(_reported(ctx, SPILLED_PREFILL_TOKENS), default=0.0)
        per_request = held / running if running >= 1 else self.default_prompt_tokens
        queued = max(0.0, float(ctx.total_queued_requests or 0.0))
        demand = held + spilled + queued * per_request
        desired = demand / self.target_tokens_per_replica
        inputs = {
            "prefill_tokens": held,
            "spilled_prefill_tokens": spilled,
            "queued_requests": queued,
            "tokens_per_request": per_request,
            "prefill_tokens_demand": demand,
            "target_tokens_per_replica": self.target_tokens_per_replica,
        }
        self.report(ctx, desired, "prefill_tokens", inputs)
        return desired, {"prefill_tokens_demand": demand}


class DecodeKVPolicy:
    """Replicas = the larger of two pressures, so neither KV nor the batch runs out:

    - KV: ``current x mean(kv_cache_usage) / target_kv_usage`` keeps the fleet's cache about
      ``target_kv_usage`` full (room left for the sequences' growth, no preemption);
    - sequences: ``(running + waiting + queued requests) / target_running_per_replica`` keeps
      the decode batch near the size where per-token latency is still acceptable.

    Waiting sequences on a decode replica mean it has no KV room or a full batch, so they
    count as demand. Tune ``target_running_per_replica`` from the ITL-vs-batch curve.
    """

    def __init__(self, target_kv_usage: float = 0.75, target_running_per_replica: float = 48):
        assert 0 < target_kv_usage <= 1 and target_running_per_replica > 0
        self.target_kv_usage = float(target_kv_usage)
        self.target_running_per_replica = float(target_running_per_replica)
        self.report = DecisionReport(type(self).__name__)

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        usage = _per_replica(ctx, KV_CACHE_USAGE)
        running = _per_replica(ctx, NUM_RUNNING)
        waiting = _per_replica(ctx, NUM_WAITING)
        if usage is None or running is None or waiting is None:
            return _fallback(ctx, self.report)
        by_kv = sum(usage) / self.target_kv_usage  # = replicas x mean usage / target
        queued = max(0.0, float(ctx.total_queued_requests or 0.0))
        seqs = sum(running) + sum(waiting) + queued
        by_seqs = seqs / self.target_running_per_replica
        inputs = {
            "kv_cache_usage_sum": sum(usage),
            "num_running": sum(running),
            "num_waiting": sum(waiting),
            "queued_requests": queued,
            "decode_by_kv": by_kv,
            "decode_by_seqs": by_seqs,
        }
        basis = "kv_cache_usage" if by_kv >= by_seqs else "sequences"
        self.report(ctx, max(by_kv, by_seqs), basis, inputs)
        return max(by_kv, by_seqs), {"decode_by_kv": by_kv, "decode_by_seqs": by_seqs}
