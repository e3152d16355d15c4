"""gRPC on the disaggregated graph (Ingress -> PrefillServer -> DecodeServer + KV store)."""

import time

import grpc
import pytest
from grpc_app import grpc_app, wait_until_idle
from reliability.serve.clients import idle_after_grpc_cancel
from serve.apps import tiny_serve_args

from app import LLM, SamplingParams
from app.serve.grpc_api.grpc_gen.grpc.health.v1 import health_pb2, health_pb2_grpc
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "slimserve-grpc-disagg"
PROMPT = "prefill here, decode there, one answer " * 4
MD = (("application", APP),)


@pytest.fixture(scope="module")
def served(ray_session, checkpoint_factory):
    from ray import serve

    model = checkpoint_factory("llama")
    args = tiny_serve_args(model, engine={"dtype": "float32"}, store_name="slimserve-grpc-kv")
    with grpc_app(ray_session, args, APP, MD) as (channel, _):
        handles = {
            n: serve.get_deployment_handle(n, APP) for n in ("PrefillServer", "DecodeServer")
        }
        yield {"model": model, "channel": channel, **handles}


@pytest.fixture(scope="module")
def stub(served):
    return generation_pb2_grpc.GenerationStub(served["channel"])


def test_stream_across_prefill_and_decode_matches_offline(served, stub):
    offline = LLM(served["model"], dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0]
    req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(max_tokens=10, temperature=0))
    messages = list(stub.Generate(req, metadata=MD, timeout=60))
    assert [t for m in messages for t in m.token_ids] == want.token_ids
    assert "".join(m.text for m in messages) == want.text
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    again = stub.Complete(req, metadata=MD, timeout=60)  # the prompt's chunks are cached now
    assert list(again.choices[0].token_ids) == want.token_ids
    assert again.usage.cached_prompt_tokens > 0


def test_health_names_both_phases(served, stub):
    health = stub.Health(pb.HealthRequest(), metadata=MD)
    assert health.status == pb.HealthResponse.STATUS_SERVING and health.kv_blocks_total > 0
    standard = health_pb2_grpc.HealthStub(served["channel"])
    check = standard.Check(health_pb2.HealthCheckRequest(), metadata=MD)
    assert check.status == health_pb2.HealthCheckResponse.SERVING


def test_cancel_and_deadline_free_decode_blocks(served, stub):
    """The deadline is also sent as timeout_s (the guaranteed path, see
    tests/reliability/serve: Serve's gRPC proxy sometimes drops a cancel), and it is short:
    the tiny model makes the 450 tokens in about a second."""
    long = pb.SamplingParams(max_tokens=450, temperature=0, ignore_eos=True)
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=long), metadata=MD)
    for _ in range(3):
        next(call)
    busy = served["DecodeServer"].stats.remote().result(timeout_s=30)
    assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    idle_after_grpc_cancel(APP, [served["DecodeServer"]], 30)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        req = pb.GenerateRequest(text=PROMPT, sampling=long, timeout_s=0.2)
        list(stub.Generate(req, metadata=MD, timeout=0.2))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 5
    for name in ("DecodeServer", "PrefillServer"):
        wait_until_idle(served[name])
