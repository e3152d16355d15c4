"""What Serve's controller sees of the load under overload: every engine call is a Serve
handle call (docs/serving.md "Transport"), so the running requests per replica that the
autoscaler's context reports agree with the engine's own count. The policies export that
view each tick (`slimserve_autoscaling_input{input="serve_running_requests_per_replica"}`,
app/serve/routing/autoscaling.py); this test scrapes it from Ray's Prometheus endpoint while four
times the decode replica's `max_ongoing_requests` stream at once."""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time

import httpx
import pytest
from serve.apps import tiny_serve_args

from ops.test_autoscaling_ray import STORE, autoscaled, deployed
from ops.test_metrics_ray import scrape

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ONGOING = 8  # the decode replica's max_ongoing_requests
OVERLOAD = 4 * ONGOING
GAUGE = "ray_slimserve_autoscaling_input"
LOOK_BACK_S = 11  # ops.test_autoscaling_ray.autoscaled's look_back_period_s
EXPORT_S = 10  # Ray exports a process's metrics every 10 s
SAMPLES = 16  # one every 2 s: three or four exports, so one odd export is not the median
STREAM = {"stream": True}
ENGINE_GAUGES = ("ray_slimserve_num_requests_running", "ray_slimserve_num_requests_waiting")


def config(model: str) -> dict:
    args = tiny_serve_args(model, store_name=STORE, max_queued_requests=-1)
    decode = autoscaled("app.serve.routing.autoscaling:DecodeKVPolicy", {}, max_replicas=1)
    decode["max_ongoing_requests"] = ONGOING
    # The decode deployment's aggregation in deploy/gpu.yaml and k8s/. Under `max` Serve's
    # running count is max(running + queued) - max(queued), two peaks of different instants
    # (Ray calls the difference approximate; one CI run read 12 against the engine's 8).
    decode["autoscaling_config"]["aggregation_function"] = "mean"
    return {
        "applications": [
            {
                "name": "slimserve",
                "route_prefix": "/",
                "import_path": "app.serve.build:build_app",
                "args": args,
                "deployments": [{"name": "DecodeServer", **decode}],
            }
        ],
    }


def views(port: int) -> tuple[float | None, float]:
    """From one scrape of Ray's Prometheus endpoint: the controller's running requests per
    replica (the policy's export) and the decode engine's own running + waiting requests
    (its replica's gauges). Ray exports both every few seconds, hence the steady window."""
    seen, engine = None, 0.0
    for name, labels, value in scrape(port):
        if name == GAUGE and labels.get("deployment") == "DecodeServer":
            if labels.get("input") == "serve_running_requests_per_replica":
                seen = value
        elif name in ENGINE_GAUGES and labels.get("role") == "decode":
            engine += value
    return seen, engine


def settled(port: int, timeout_s: float = 120) -> None:
    """Once the engine's gauges show the replica full, one look-back window and one export
    later. Serve's mean of its queued requests can still hold the ramp then (read 11.5
    against the engine's 8 in the export after, then 9): the samples span several exports."""
    deadline = time.monotonic() + timeout_s
    while views(port)[1] < ONGOING:
        assert time.monotonic() < deadline, "the decode replica never filled"
        time.sleep(1)
    time.sleep(LOOK_BACK_S + EXPORT_S)


def test_the_controller_sees_the_engines_ongoing_requests_under_overload(
    ray_session, checkpoint_factory
):
    """Four times the decode replica's max_ongoing_requests keep streaming; over the steady
    overload the controller's running requests per replica (median of its exported view)
    is within 20% of the engine's own count (median of its gauges). Serve counts one
    request more than the 32 streams (33 ongoing, 24 queued: a view of 9 against 8). Seen
    failing (the view stayed at 0) with the policy's report not given Serve's running
    count."""
    model = checkpoint_factory("llama", max_position_embeddings=8192)
    port = ray_session._private.worker._global_node.metrics_export_port
    body = {"model": "tiny", "prompt": "x y z", "max_tokens": 8000, "ignore_eos": True}
    stop = threading.Event()

    def client():
        """Streams requests that outlast the test, and drops the last one (a disconnect
        cancels it): the replica holds the same requests all along, not waves of equal
        requests that end together and refill."""
        with httpx.Client(timeout=300) as http:
            while not stop.is_set():
                with http.stream("POST", url + "/v1/completions", json=body | STREAM) as r:
                    assert r.status_code == 200, r.read()
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break

    pool = concurrent.futures.ThreadPoolExecutor(OVERLOAD)
    with deployed(ray_session, config(model)) as url, pool:
        clients = [pool.submit(client) for _ in range(OVERLOAD)]
        settled(port)
        engine, seen = [], []
        for _ in range(SAMPLES):
            view, count = views(port)
            seen.append(view)
            engine.append(count)
            time.sleep(2)
        stop.set()
        for c in clients:
            c.result()  # no client failed
    assert None not in seen, seen
    true, view = statistics.median(engine), statistics.median(seen)
    assert true == ONGOING, engine  # the replica was full all along
    assert abs(view - true) <= 0.2 * true, (engine, seen)
