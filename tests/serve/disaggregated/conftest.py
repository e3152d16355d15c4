"""The disaggregated app its tests share: two prefill replicas, one decode replica, one store
shard; prompts of more than LOCAL_LIMIT tokens go through a prefill replica, computed in steps
of STEP tokens (a 380-token prompt hands its KV off in 2 parts, then the result). Module-scoped:
each test module gets an app of its own."""

import pytest
from ray import serve

from app import LLM
from app.kvstore.store import KVStoreClient
from serve.apps import running_app, tiny_serve_args
from serve.disaggregated.app_helpers import LOCAL_LIMIT, STEP


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    # Wide enough that computing a 380-token prompt costs more than fetching its KV.
    return checkpoint_factory("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4)


@pytest.fixture(scope="module")
def offline(model):
    return LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")


@pytest.fixture(scope="module")
def url(ray_session, model):
    # Conditional disaggregation: the other tests' prompts are longer than LOCAL_LIMIT,
    # through a prefill replica.
    args = tiny_serve_args(
        model,
        num_prefill_replicas=2,
        local_prefill_max_tokens=LOCAL_LIMIT,
        # A 380-token prompt is computed in 3 steps: an overlapped hand-off (2 parts)
        engine={"dtype": "float32", "long_prefill_chunk": STEP},
    )
    with running_app(ray_session, args) as u:
        yield u


@pytest.fixture(scope="module")
def store(url):
    return KVStoreClient.from_name("slimserve-kvstore", 1)


@pytest.fixture(scope="module")
def info(url):
    return serve.get_deployment_handle("PrefillServer", "slimserve").describe.remote().result()
