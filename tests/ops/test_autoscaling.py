"""The custom autoscaling policies (app/serve/routing/autoscaling.py) on hand-made contexts."""

from __future__ import annotations

import logging

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from app.serve.routing.autoscaling import (
    KV_CACHE_USAGE,
    NUM_REQUESTS,
    NUM_RUNNING,
    NUM_WAITING,
    PREFILL_TOKENS,
    SPILLED_PREFILL_TOKENS,
    DecodeKVPolicy,
    PrefillTokenPolicy,
    SpilledDemand,
    autoscaling_stats,
)

DEP = DeploymentID(name="PrefillServer", app_name="slimserve")


def context(
    per_replica: dict[str, list[float]] | None,
    num_replicas: int,
    total_requests: float = 0.0,
    queued: float = 0.0,
    **config,
) -> AutoscalingContext:
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(num_replicas)]
    metrics = None
    if per_replica is not None:
        metrics = {name: dict(zip(replicas, values)) for name, values in per_replica.items()}
    cfg = AutoscalingConfig(min_replicas=1, max_replicas=16, **config)
    return AutoscalingContext(
        deployment_id=DEP,
        deployment_name=DEP.name,
        app_name=DEP.app_name,
        current_num_replicas=num_replicas,
        target_num_replicas=num_replicas,
        running_replicas=replicas,
        total_num_requests=total_requests,
        total_queued_requests=queued,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=cfg.min_replicas,
        capacity_adjusted_max_replicas=cfg.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=cfg,
    )


def prefill_ctx(tokens, requests, queued=0.0, **config):
    metrics = {PREFILL_TOKENS: tokens, NUM_REQUESTS: requests}
    return context(metrics, len(tokens), sum(requests) + queued, queued, **config)


def decode_ctx(usage, running, waiting, queued=0.0, **config):
    metrics = {KV_CACHE_USAGE: usage, NUM_RUNNING: running, NUM_WAITING: waiting}
    return context(metrics, len(usage), sum(running) + queued, queued, **config)


def test_prefill_scales_on_tokens_not_requests():
    policy = PrefillTokenPolicy(target_tokens_per_replica=8000)
    # One long prompt per replica: few requests, many tokens -> more replicas.
    desired, state = policy(prefill_ctx([16000, 16000], [1, 1]))
    assert desired == pytest.approx(4.0)
    assert state["prefill_tokens_demand"] == 32000
    # Many short prompts: many requests, few tokens -> fewer replicas.
    desired, _ = policy(prefill_ctx([800, 800], [10, 10]))
    assert desired == pytest.approx(0.2)


def test_prefill_counts_handle_queue_at_mean_tokens_per_request():
    policy = PrefillTokenPolicy(target_tokens_per_replica=1000)
    desired, _ = policy(prefill_ctx([2000], [4], queued=6))  # 500 tokens/request
    assert desired == pytest.approx((2000 + 6 * 500) / 1000)
    idle = PrefillTokenPolicy(target_tokens_per_replica=1000, default_prompt_tokens=300)
    desired, _ = idle(prefill_ctx([0.0], [0.0], queued=10))
    assert desired == pytest.approx(3.0)


def test_prefill_counts_the_demand_spilled_to_decode_replicas():
    """Long prompts placed on decode replicas because the prefill queue was long are demand
    for prefill replicas: the placement policy spilling them must not make the prefill
    deployment look idle. Every replica is told the same total, so the largest report
    counts (a replica that joined since, or of an older version, may report less or
    nothing). Seen failing (2.0, not 3.5) with the spilled tokens left out of the demand,
    and (5.0) with the reports summed."""
    policy = PrefillTokenPolicy(target_tokens_per_replica=1000)
    ctx = prefill_ctx([1000, 1000], [2, 2])
    ctx.aggregated_metrics[SPILLED_PREFILL_TOKENS] = dict(zip(ctx.running_replicas, [1500, 1500]))
    desired, state = policy(ctx)
    assert desired == pytest.approx(3.5) and state["prefill_tokens_demand"] == 3500
    one = prefill_ctx([1000, 1000], [2, 2])
    one.aggregated_metrics[SPILLED_PREFILL_TOKENS] = {one.running_replicas[0]: 1500}
    assert policy(one)[0] == pytest.approx(3.5)  # the other replica has not reported it
    assert policy(prefill_ctx([1000, 1000], [2, 2]))[0] == pytest.approx(2.0)  # none told


def test_a_told_spilled_share_lasts_until_no_ingress_refreshes_it():
    """The latest share told counts (ingresses all tell the same total: no sum), and an
    old one counts 0. Seen failing (700 after the ttl) with the expiry removed."""
    now = [0.0]
    demand = SpilledDemand(ttl_s=2.0, clock=lambda: now[0])
    assert demand.tokens == 0
    demand.tell(500)
    demand.tell(700)
    now[0] = 2.0
    assert demand.tokens == 700
    now[0] = 2.1
    assert demand.tokens == 0


def test_decode_scales_on_kv_usage():
    policy = DecodeKVPolicy(target_kv_usage=0.5, target_running_per_replica=1000)
    desired, state = policy(decode_ctx([0.9, 0.7], [4, 4], [0, 0]))
    assert desired == pytest.approx(3.2)  # 2 replicas x 0.8 mean / 0.5
    assert state["decode_by_kv"] == pytest.approx(3.2)


def test_decode_scales_on_running_and_waiting_sequences():
    policy = DecodeKVPolicy(target_kv_usage=0.9, target_running_per_replica=16)
    desired, state = policy(decode_ctx([0.1, 0.1], [30, 30], [2, 2], queued=0))
    assert desired == pytest.approx(64 / 16)
    assert desired == state["decode_by_seqs"] > state["decode_by_kv"]


def test_fallback_to_request_count_until_replicas_report():
    ctx = context(None, 2, total_requests=8, target_ongoing_requests=2)
    assert PrefillTokenPolicy()(ctx)[0] == pytest.approx(4.0)
    assert DecodeKVPolicy()(ctx)[0] == pytest.approx(4.0)
    # One replica has not reported yet: same fallback.
    partial = prefill_ctx([100, 100], [1, 1])
    del partial.aggregated_metrics[PREFILL_TOKENS][partial.running_replicas[1]]
    assert PrefillTokenPolicy()(partial)[0] == pytest.approx(partial.total_num_requests / 2)


def test_serve_wrapper_applies_delays_and_factors():
    """Through Serve's own wrapper: no upscale before upscale_delay_s, then the policy's."""
    wrapped = _apply_autoscaling_config(PrefillTokenPolicy(target_tokens_per_replica=1000))
    ctx = prefill_ctx([5000], [5], upscale_delay_s=0.0)
    n, _ = wrapped(ctx)
    assert n == 5
    slow = prefill_ctx([5000], [5], upscale_delay_s=3600.0)
    n, _ = wrapped(slow)
    assert n == 1  # decision pending until the delay passes
    half = prefill_ctx([5000], [5], upscale_delay_s=0.0, upscaling_factor=0.5)
    n, _ = wrapped(half)
    assert n == 3  # 1 + 0.5 x (5 - 1)


def test_autoscaling_stats_from_engine_stats():
    stats = {"kv_cache_usage": 0.25, "num_running": 3, "num_waiting": 1}
    out = autoscaling_stats(stats, inflight_tokens=700, spilled_tokens=90)
    assert out == {
        PREFILL_TOKENS: 700.0,
        SPILLED_PREFILL_TOKENS: 90.0,
        NUM_REQUESTS: 4.0,
        KV_CACHE_USAGE: 0.25,
        NUM_RUNNING: 3.0,
        NUM_WAITING: 1.0,
    }
    assert all(isinstance(v, float) for v in out.values())  # what Serve's hook requires


def test_bad_knobs_are_rejected():
    with pytest.raises(AssertionError):
        DecodeKVPolicy(target_kv_usage=1.5)
    with pytest.raises(AssertionError):
        PrefillTokenPolicy(target_tokens_per_replica=0)


@pytest.fixture
def decisions():
    """The lines the policies write to Serve's controller logger ("ray.serve")."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    serve_logger = logging.getLogger("ray.serve")
    handler, level = Keep(level=logging.INFO), serve_logger.level
    serve_logger.addHandler(handler)
    serve_logger.setLevel(logging.INFO)
    yield lines
    serve_logger.removeHandler(handler)
    serve_logger.setLevel(level)


def test_a_decision_is_logged_when_it_changes_with_its_inputs(decisions):
    policy = PrefillTokenPolicy(target_tokens_per_replica=1000)
    policy(prefill_ctx([2500], [5]))
    policy(prefill_ctx([2600], [5]))  # still 3 replicas by prompt tokens: no new line
    assert len(decisions) == 1
    line = decisions[0]
    assert line.startswith("slimserve autoscaling: PrefillServer (slimserve) wants 3 replicas")
    assert "raw 2.500" in line and "by prefill_tokens [PrefillTokenPolicy]" in line
    assert "prefill_tokens=2500" in line and "prefill_tokens_demand=2500" in line
    assert "bounds 1..16" in line
    policy(prefill_ctx([4200], [5]))
    assert len(decisions) == 2 and "wants 5 replicas" in decisions[1]


def test_the_basis_of_a_decision_is_named(decisions):
    fallback = context(None, 2, total_requests=8, target_ongoing_requests=2)
    decode = DecodeKVPolicy(target_kv_usage=0.5, target_running_per_replica=1000)
    decode(fallback)
    decode(decode_ctx([0.9, 0.7], [4, 4], [0, 0]))  # also 4 replicas, now by KV usage
    assert len(decisions) == 2
    assert "by request_count" in decisions[0] and "total_requests=8" in decisions[0]
    assert "by kv_cache_usage [DecodeKVPolicy]" in decisions[1]
    assert "decode_by_kv=3.2" in decisions[1]
    decode(decode_ctx([0.1, 0.1], [900, 900], [300, 0]))
    assert "wants 3 replicas" in decisions[2] and "by sequences" in decisions[2]
