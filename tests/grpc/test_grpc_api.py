"""The gRPC API end to end, the happy path: a real grpcio client on Serve's gRPC proxy,
next to the HTTP API and the offline engine. Errors, auth and aborts: test_grpc_errors.py.

One `serve.run` for the module (tests/grpc/conftest.py).
"""

import threading

import grpc
import httpx
import pytest
from api_app import APP, KEY_A, LONG_CONTEXT, PROMPT, code_of, greedy, wait_until_idle

from app import SamplingParams
from app.serve.grpc_api.grpc_gen.grpc.health.v1 import health_pb2, health_pb2_grpc
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb

pytestmark = [pytest.mark.ray, pytest.mark.slow]


STREAM_TOKENS = 40


def test_stream_matches_http_and_offline(served, stub, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=STREAM_TOKENS))[0]
    req = pb.GenerateRequest(model="tiny", text=PROMPT, sampling=greedy(STREAM_TOKENS, logprobs=2))
    messages = list(stub.Generate(req, metadata=KEY_A, timeout=60))
    # Streamed, not one blob. The ingress merges deltas that queued while it lagged, so a
    # short answer from the tiny model could arrive whole on a loaded machine (seen once
    # at 12 tokens); 40 tokens take several steps longer than any such lag.
    assert len(messages) > 1
    ids = [t for m in messages for t in m.token_ids]
    assert ids == want.token_ids
    assert "".join(m.text for m in messages) == want.text
    assert [m.finish_reason for m in messages][-1] == pb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    usage = messages[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(want.prompt_token_ids),
        STREAM_TOKENS,
    )
    assert usage.total_tokens == usage.prompt_tokens + STREAM_TOKENS
    for m in messages:
        assert len(m.logprobs) == len(m.token_ids)
        assert all(lp.token_id == t and len(lp.top) == 2 for lp, t in zip(m.logprobs, m.token_ids))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": STREAM_TOKENS, "temperature": 0}
    http = httpx.post(served["http"] + "/v1/completions", json=body, timeout=60).json()
    assert http["choices"][0]["text"] == want.text
    assert http["usage"]["completion_tokens"] == usage.completion_tokens


def test_complete_chat_token_ids_and_n(served, stub, offline):
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = stub.Complete(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=greedy(12)), metadata=KEY_A
    )
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    assert list(by_ids.choices[0].token_ids) == want.token_ids and by_ids.model == "tiny"
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hello world")])
    got = stub.Complete(pb.GenerateRequest(chat=chat, sampling=greedy(10)), metadata=KEY_A)
    messages = [{"role": "user", "content": "hello world"}]
    assert (
        got.choices[0].text
        == offline.chat(messages, SamplingParams(temperature=0, max_tokens=10))[0].text
    )
    sampled = pb.SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=7)
    three = stub.Complete(
        pb.GenerateRequest(text=PROMPT, sampling=sampled, request_id="mine-1"), metadata=KEY_A
    )
    assert three.request_id == "mine-1" and [c.index for c in three.choices] == [0, 1, 2]
    assert three.usage.completion_tokens == 18
    assert len({tuple(c.token_ids) for c in three.choices}) > 1


def test_multi_turn_tool_conversation(stub, offline):
    """A tool call and its answer sent back over gRPC reach the chat template as over HTTP
    (the test template renders both): Tokenize and Complete equal the offline engine given
    OpenAI's message JSON. Seen failing before ChatMessage had tool_calls / tool_call_id
    (the client could not send them; the template got role and content only)."""
    from test_grpc_convert import TOOL_CHAT, TOOL_TURNS

    want_ids = offline.tokenizer.encode_chat(TOOL_TURNS)
    bare = [{"role": m["role"], "content": m["content"]} for m in TOOL_TURNS]
    assert want_ids != offline.tokenizer.encode_chat(bare)  # the fields change the prompt
    tok = stub.Tokenize(pb.TokenizeRequest(chat=TOOL_CHAT), metadata=KEY_A)
    assert list(tok.token_ids) == want_ids
    got = stub.Complete(pb.GenerateRequest(chat=TOOL_CHAT, sampling=greedy(6)), metadata=KEY_A)
    want = offline.chat(TOOL_TURNS, SamplingParams(temperature=0, max_tokens=6))[0]
    assert list(got.choices[0].token_ids) == want.token_ids
    assert got.usage.prompt_tokens == len(want_ids)


def test_tokenize_detokenize_models_and_health(served, stub, offline):
    tok = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), metadata=KEY_A)
    assert (
        list(tok.token_ids) == offline.tokenizer.encode(PROMPT)
        and tok.max_model_len == LONG_CONTEXT
    )
    text = stub.Detokenize(pb.DetokenizeRequest(token_ids=tok.token_ids), metadata=KEY_A).text
    assert text.strip() == PROMPT.strip()
    models = stub.ListModels(pb.ListModelsRequest(), metadata=KEY_A).models
    assert [(m.id, m.vocab_size, m.kv_cache_dtype) for m in models] == [("tiny", 320, "fp8_e4m3")]
    health = stub.Health(pb.HealthRequest(), metadata=KEY_A)
    assert health.status == pb.HealthResponse.STATUS_SERVING and health.kv_blocks_total > 0
    # Standard grpc.health.v1, with no metadata at all (what probes send): one app, no key.
    standard = health_pb2_grpc.HealthStub(served["channel"])
    serving = health_pb2.HealthCheckResponse.SERVING
    assert standard.Check(health_pb2.HealthCheckRequest()).status == serving
    named = health_pb2.HealthCheckRequest(service="slimserve.v1.Generation")
    assert standard.Check(named).status == serving
    bad = health_pb2.HealthCheckRequest(service="nope.v1.Nothing")
    assert code_of(lambda: standard.Check(bad)).code() == grpc.StatusCode.NOT_FOUND
    watch = standard.Watch(health_pb2.HealthCheckRequest())
    assert next(watch).status == serving
    watch.cancel()
    # Reflection (what grpcurl uses) lists our services next to Serve's.
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    services = ProtoReflectionDescriptorDatabase(served["channel"]).get_services()
    assert {"slimserve.v1.Generation", "grpc.health.v1.Health"} <= set(services)
    # Serve's own built-in service on the same port.
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    serve_api = serve_pb2_grpc.RayServeAPIServiceStub(served["channel"])
    assert serve_api.Healthz(serve_pb2.HealthzRequest()).message == "success"
    apps = serve_api.ListApplications(serve_pb2.ListApplicationsRequest()).application_names
    assert APP in apps


def test_many_concurrent_streams_complete(served, stub):
    results: dict[int, list] = {}

    def run(i: int) -> None:
        req = pb.GenerateRequest(text=f"stream {i} " + PROMPT, sampling=greedy(16, ignore_eos=True))
        results[i] = list(stub.Generate(req, metadata=KEY_A, timeout=120))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(16))
    for messages in results.values():
        assert sum(len(m.token_ids) for m in messages) == 16
        assert messages[-1].usage.completion_tokens == 16
    wait_until_idle(served)
