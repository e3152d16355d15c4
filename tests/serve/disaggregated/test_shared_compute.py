"""The default placement when a prefill replica runs on its decode replica's cores (every
CPU replica of this box with `torch_threads: auto`): long prompts prefill on the decode
replica (app/serve/routing/compute.py). An app of its own: the other disaggregated tests
place by load (tests/serve/apps.py)."""

import os

import pytest
import ray
from polling import eventually
from ray import serve

from app.engine.step_threads import available_cpus
from app.serve.routing.compute import Compute, shares_compute
from serve.apps import running_app, tiny_serve_args
from serve.disaggregated.app_helpers import LOCAL_LIMIT, complete, prompt_ids, want_text

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def url(ray_session, model):
    args = tiny_serve_args(
        model,
        local_prefill_max_tokens=LOCAL_LIMIT,
        prefill_on_shared_compute="local",  # ServeArgs' default
        engine={"dtype": "float32", "torch_threads": "auto"},
    )
    with running_app(ray_session, args) as u:
        yield u


def prefill_via(url, prompt) -> str:
    return complete(url, prompt)["slimserve"]["choices"][0]["prefill_via"]


def compute_of(deployment: str) -> Compute:
    load = serve.get_deployment_handle(deployment, "slimserve").placement_load.remote().result()
    return Compute.from_report(load["compute"])


def test_replicas_report_the_cores_they_share(url):
    """Each replica reports this node, the CPUs it may use and its long steps' threads;
    on one CPU box, with threads for every CPU, a prefill and a decode replica share them."""
    computes = [compute_of(name) for name in ("PrefillServer", "DecodeServer")]
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    node = ray.get_runtime_context().get_node_id()
    for c in computes:
        assert (c.node_id, c.gpus, c.cpus, c.threads) == (node, (), cpus, available_cpus())
    assert shares_compute(*computes)


def test_long_prompts_prefill_on_the_decode_replica_and_match_offline(url, offline):
    """Seen failing (prefill_via "remote") with the shared-compute rule removed."""
    # the ingress places by load once the replicas have reported (routing_stats_period_s)
    assert eventually(lambda: prefill_via(url, prompt_ids(99)) == "local", 30)
    for seed in range(3):
        prompt = prompt_ids(seed)  # 380 tokens, far over LOCAL_LIMIT
        got = complete(url, prompt)
        assert got["slimserve"]["choices"][0]["prefill_via"] == "local"
        assert got["choices"][0]["text"] == want_text(offline, prompt)


def test_replicas_report_the_rates_measured_of_their_steps(url):
    """After long prompts prefilled on it, the decode replica reports its measured prefill
    rate and decode step time (the placement's measured inputs: app/engine/step_rates.py).
    Seen failing with `placement_load` leaving them out (None)."""
    complete(url, prompt_ids(7))  # a long prompt's prefill, and its decode steps
    handle = serve.get_deployment_handle("DecodeServer", "slimserve")
    load = handle.placement_load.remote().result()
    assert load["prefill_rate"] > 0 and 0 < load["decode_step_s"] < 10


def test_a_prefill_replica_reports_the_spilled_demand_it_is_told(url):
    """Through Serve: the decode replica reports `spilled_prefill_tokens` (none left once
    its local prefills are done), and a prefill replica reports
    what it is told as its autoscaling input `spilled_prefill_tokens` (the ingress's part,
    the telling, is tests/serve/test_load_view.py; the whole loop,
    tests/ops/test_autoscaling_ray.py). Seen failing (0.0) with the told value left out of
    `EngineHost.autoscaling_stats`."""
    complete(url, prompt_ids(8))  # a long prompt, prefilled on the decode replica
    decode = serve.get_deployment_handle("DecodeServer", "slimserve")
    assert decode.placement_load.remote().result()["spilled_prefill_tokens"] == 0
    prefill = serve.get_deployment_handle("PrefillServer", "slimserve")
    prefill.tell_spilled_demand.remote(300).result()
    stats = prefill.record_autoscaling_stats.remote().result()
    assert stats["spilled_prefill_tokens"] == 300.0
