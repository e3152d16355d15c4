"""The custom policies drive a live Serve app: a prompt-token burst scales prefill out while
decode (no decode work: max_tokens=1) stays at its minimum. Deployed from a Serve config,
the way `serve deploy` / KubeRay do it."""

from __future__ import annotations

import concurrent.futures
import contextlib
import glob
import os
import re
import time

import httpx
import numpy as np
import pytest
from serve.apps import PORT, tiny_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]
STORE = "slimserve-kvstore-autoscaling-test"  # its own store (see test_metrics_ray.py)
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}


def autoscaled(policy: str, kwargs: dict, **bounds) -> dict:
    return {
        "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": FAST_METRICS}},
        "autoscaling_config": {
            "min_replicas": 1,
            "max_replicas": 2,
            "look_back_period_s": 11,
            "upscale_delay_s": 0,
            "downscale_delay_s": 600,
            "aggregation_function": "max",
            # Serve's request-count fallback alone would never scale out at 4 concurrent
            # requests: a scale-out below comes from the replicas' token metrics.
            "target_ongoing_requests": 100,
            "policy": {"policy_function": policy, "policy_kwargs": kwargs},
            **bounds,
        },
    }


def config(model: str, **prefill_bounds) -> dict:
    args = tiny_serve_args(model, store_name=STORE)
    prefill = autoscaled(
        "app.serve.routing.autoscaling:PrefillTokenPolicy",
        {"target_tokens_per_replica": 64},
        **prefill_bounds,
    )
    decode = autoscaled("app.serve.routing.autoscaling:DecodeKVPolicy", {"target_kv_usage": 0.9})
    return {
        "http_options": {"host": "127.0.0.1", "port": PORT},
        "applications": [
            {
                "name": "slimserve",
                "route_prefix": "/",
                "import_path": "app.serve.build:build_app",
                "args": args,
                "deployments": [
                    {"name": "PrefillServer", **prefill},
                    {"name": "DecodeServer", **decode},
                ],
            }
        ],
    }


def replicas(name: str) -> int:
    """Replicas the deployment has or is starting (an autoscaling decision adds one)."""
    from ray import serve

    status = serve.status().applications["slimserve"].deployments[name]
    return sum(n for state, n in status.replica_states.items() if state != "STOPPING")


def wait_running(app: str, deadline_s: float) -> None:
    from ray import serve

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        assert status is None or status.status != "DEPLOY_FAILED", status.message
        time.sleep(1)
    raise TimeoutError(f"{app} not RUNNING after {deadline_s}s")


@contextlib.contextmanager
def deployed(ray_session, cfg: dict):
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from app.kvstore.store import KVStoreClient

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    assert not serve.status().applications, "another test left a Serve app running"
    try:
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(cfg))
        wait_running("slimserve", deadline_s=240)  # Serve's own blocking wait stops at 60 s
        yield f"http://127.0.0.1:{PORT}"
    finally:
        serve.delete("slimserve")
        with contextlib.suppress(Exception):
            for shard in KVStoreClient.from_name(STORE, 1).shards:
                ray_session.kill(shard)


def burst(url: str, rng: np.random.Generator) -> None:
    """8 fresh 350-token prompts (first token only) from 4 clients at once."""
    prompts = [[int(t) for t in rng.integers(3, 300, 350)] for _ in range(8)]

    def one(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, prompts))


def test_prefill_scales_out_on_prompt_tokens_while_decode_stays(ray_session, checkpoint_factory):
    with deployed(ray_session, config(checkpoint_factory("llama"))) as url:
        assert replicas("PrefillServer") == 1 and replicas("DecodeServer") == 1
        rng, deadline = np.random.default_rng(1), time.monotonic() + 180
        while replicas("PrefillServer") < 2 and time.monotonic() < deadline:
            burst(url, rng)
        assert replicas("PrefillServer") == 2, "prefill did not scale out on prompt tokens"
        assert replicas("DecodeServer") == 1


def test_the_prefill_policy_counts_the_prompts_spilled_to_the_decode_replica(
    ray_session, checkpoint_factory
):
    """The whole loop, live: bursts queue long prompts on the one prefill replica (kept at
    one), so placement sends some to the idle decode replica as faster; the decode replica
    reports their tokens, the ingress tells the prefill replica, Serve aggregates its
    report, and PrefillTokenPolicy counts it: a decision in the controller's log with
    `spilled_prefill_tokens` > 0. Seen failing (none in 60 s) with the decode replica not
    counting `DecodeRequest.spilled_tokens`."""
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    pattern = os.path.join(logs, "serve", "controller_*.log")
    seen = {path: os.path.getsize(path) for path in glob.glob(pattern)}  # earlier tests'
    with deployed(ray_session, config(checkpoint_factory("llama"), max_replicas=1)) as url:
        rng, deadline, spilled = np.random.default_rng(2), time.monotonic() + 60, []
        while not spilled and time.monotonic() < deadline:
            burst(url, rng)
            spilled = [v for v in spilled_decisions(pattern, seen) if v > 0]
    assert spilled, "no prefill decision counted spilled tokens"


def spilled_decisions(pattern: str, skip: dict[str, int]) -> list[float]:
    """`spilled_prefill_tokens` of PrefillTokenPolicy's decisions logged after ``skip``
    (bytes already in each controller log)."""
    values = []
    for path in glob.glob(pattern):
        with open(path, errors="replace") as f:
            f.seek(skip.get(path, 0))
            text = f.read()
        values += [
            float(v) for v in re.findall(r"PrefillServer .*spilled_prefill_tokens=(\S+)", text)
        ]
    return values
