"""Fixtures of the gRPC API tests (tests/grpc/test_grpc_api.py, test_grpc_errors.py).

Each of those modules gets one `serve.run` (colocated tiny model, API keys required, small
queues so that overload is reachable); tests/grpc/grpc_app.py starts and stops Serve around
it. test_grpc_disaggregated.py declares its own `served` and `stub`, which win over these.
"""

import pytest
from api_app import APP, ENGINE_ONGOING, ENGINE_QUEUED, KEY_A, LONG_CONTEXT
from grpc_app import grpc_app
from serve.apps import tiny_serve_args

from app import LLM
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc


@pytest.fixture(scope="module")
def served(ray_session, checkpoint_factory):
    from ray import serve

    model = checkpoint_factory("llama", max_position_embeddings=LONG_CONTEXT)
    args = tiny_serve_args(
        model,
        engine={"dtype": "float32"},
        mode="colocated",
        grpc_require_api_key=True,
        max_ongoing_requests=ENGINE_ONGOING,
        max_queued_requests=ENGINE_QUEUED,
    )
    with grpc_app(ray_session, args, APP, KEY_A) as (channel, http):
        engine = serve.get_deployment_handle("EngineServer", APP)
        yield {"model": model, "channel": channel, "http": http, "engine": engine}


@pytest.fixture(scope="module")
def stub(served):
    return generation_pb2_grpc.GenerationStub(served["channel"])


@pytest.fixture(scope="module")
def offline(served):
    return LLM(served["model"], dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
