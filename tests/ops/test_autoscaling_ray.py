"""The custom policies drive a live Serve app: a prompt-token burst scales prefill out while
decode (no decode work: max_tokens=1) stays at its minimum. Deployed from a Serve config,
the way `serve deploy` / KubeRay do it."""

from __future__ import annotations

import concurrent.futures
import contextlib
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


def config(model: str) -> dict:
    args = tiny_serve_args(model, store_name=STORE)
    prefill = autoscaled(
        "app.serve.routing.autoscaling:PrefillTokenPolicy", {"target_tokens_per_replica": 64}
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


def test_prefill_scales_out_on_prompt_tokens_while_decode_stays(ray_session, checkpoint_factory):
    model = checkpoint_factory("llama")
    rng = np.random.default_rng(1)

    def one(_):
        prompt = [int(t) for t in rng.integers(3, 300, 350)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    with deployed(ray_session, config(model)) as url:
        assert replicas("PrefillServer") == 1 and replicas("DecodeServer") == 1
        deadline = time.monotonic() + 180
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            while replicas("PrefillServer") < 2 and time.monotonic() < deadline:
                list(pool.map(one, range(8)))
        assert replicas("PrefillServer") == 2, "prefill did not scale out on prompt tokens"
        assert replicas("DecodeServer") == 1
