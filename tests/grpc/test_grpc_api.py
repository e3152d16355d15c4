"""The gRPC API end to end: a real grpcio client on Serve's gRPC proxy, next to the HTTP API.

One `serve.run` for the module (colocated tiny model, API keys required, small queues so
that overload is reachable); tests/grpc/grpc_app.py starts and stops Serve around it.
"""

import threading
import time

import grpc
import httpx
import pytest
from grpc_app import grpc_app
from grpc_app import wait_until_idle as wait_idle
from serve.apps import tiny_serve_args

from app import LLM, SamplingParams
from app.serve.grpc_gen.grpc.health.v1 import health_pb2, health_pb2_grpc
from app.serve.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_gen.slimserve.v1 import generation_pb2_grpc

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "slimserve-grpc"
PROMPT = "the quick brown fox jumps over the lazy dog " * 3
KEY_A = (("application", APP), ("authorization", "Bearer key-tenant-a"))
KEY_B = (("application", APP), ("authorization", "Bearer key-tenant-b"))
ENGINE_ONGOING, ENGINE_QUEUED = 8, 16  # per engine replica; ingress takes 4x the first
# An 8k context and 6,000 tokens: a LONG request cannot end on its own while a test waits
# for its abort (the tiny model streams a few hundred tokens a second here).
LONG_CONTEXT = 8192
LONG = pb.SamplingParams(max_tokens=6000, temperature=0, ignore_eos=True)
ABORT_BOUND_S = 10.0


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


def engine_stats(served) -> dict:
    return served["engine"].stats.remote().result(timeout_s=30)


def wait_until_idle(served, timeout_s: float = 30) -> dict:
    return wait_idle(served["engine"], timeout_s)


def greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


# --- the happy path ---------------------------------------------------------------------


def test_stream_matches_http_and_offline(served, stub, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0]
    req = pb.GenerateRequest(model="tiny", text=PROMPT, sampling=greedy(12, logprobs=2))
    messages = list(stub.Generate(req, metadata=KEY_A, timeout=60))
    assert len(messages) > 1  # streamed, not one blob
    ids = [t for m in messages for t in m.token_ids]
    assert ids == want.token_ids
    assert "".join(m.text for m in messages) == want.text
    assert [m.finish_reason for m in messages][-1] == pb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert [m.HasField("usage") for m in messages] == [False] * (len(messages) - 1) + [True]
    usage = messages[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(want.prompt_token_ids), 12)
    assert usage.total_tokens == usage.prompt_tokens + 12
    for m in messages:
        assert len(m.logprobs) == len(m.token_ids)
        assert all(lp.token_id == t and len(lp.top) == 2 for lp, t in zip(m.logprobs, m.token_ids))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
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


def test_denormal_temperature_is_greedy_and_infinite_penalty_is_invalid(stub, offline):
    """Over gRPC a double can be a denormal or inf: the first is greedy (its limit), the
    second INVALID_ARGUMENT naming the field; neither is an INTERNAL error."""
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0]
    tiny = pb.SamplingParams(max_tokens=8, temperature=5e-324)
    got = stub.Complete(pb.GenerateRequest(text=PROMPT, sampling=tiny), metadata=KEY_A)
    assert list(got.choices[0].token_ids) == want.token_ids
    inf = pb.SamplingParams(max_tokens=8, repetition_penalty=float("inf"))
    err = code_of(
        lambda: stub.Complete(pb.GenerateRequest(text=PROMPT, sampling=inf), metadata=KEY_A)
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.repetition_penalty" in err.details()


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


# --- errors -------------------------------------------------------------------------------

BAD = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), "token ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 450)), "at most 400"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=7)), "temperature"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)), "top_p"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=99)), "sampling.n"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logprobs=21)), "logprobs"),
    (pb.GenerateRequest(text="hi", request_id="has space"), "request_id"),
    (pb.GenerateRequest(chat=pb.Chat()), "messages"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot")])), "chat.messages"),
]


@pytest.mark.parametrize("req,words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_invalid_argument_on_both_methods(stub, req, words):
    for method in (stub.Complete, lambda r, **kw: list(stub.Generate(r, **kw))):
        err = code_of(lambda m=method: m(req, metadata=KEY_A, timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert words.lower() in err.details().lower()


def test_unparsable_message_is_invalid_argument(served):
    """A string field that is not UTF-8: the proxy cannot parse it; still not INTERNAL."""
    raw = b"\x12\x02\xff\xfe"  # GenerateRequest.text (field 2) = b"\xff\xfe"
    for method in ("Complete", "Generate"):
        path = f"/slimserve.v1.Generation/{method}"
        call = served["channel"].unary_unary if method == "Complete" else None
        call = call or served["channel"].unary_stream
        err = code_of(lambda c=call, p=path: list_or_one(c(p)(raw, metadata=KEY_A, timeout=30)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.details()


def list_or_one(result):
    return result if isinstance(result, bytes) else list(result)


def test_unknown_model_and_auth(stub):
    req = pb.GenerateRequest(model="gpt-4", text="hi")
    err = code_of(lambda: stub.Complete(req, metadata=KEY_A))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'tiny'" in err.details()
    err = code_of(lambda: list(stub.Generate(req, metadata=KEY_A)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    ok = pb.GenerateRequest(text="hi", sampling=greedy(2))
    for metadata in ((("application", APP),), (("authorization", "Bearer wrong"),)):
        err = code_of(lambda md=metadata: stub.Complete(ok, metadata=md))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization" in err.details()
    x_api_key = (("x-api-key", "key-tenant-b"),)
    assert stub.Complete(ok, metadata=x_api_key).usage.completion_tokens == 2


def test_tenants_get_their_own_cache_salt(stub):
    req = pb.GenerateRequest(
        text="tenant isolation keeps every prefix apart " * 3, sampling=greedy(2)
    )

    def cached(metadata) -> int:
        return stub.Complete(req, metadata=metadata).usage.cached_prompt_tokens

    assert cached(KEY_A) == 0
    assert cached(KEY_B) == 0  # same prompt, other tenant: no hit
    assert cached(KEY_A) > 0


def test_deadline_exceeded_aborts_and_frees_blocks(served, stub):
    """Seen failing with AsyncEngine's abort made a no-op: blocks held past ABORT_BOUND_S."""
    call = stub.Generate(
        pb.GenerateRequest(text=PROMPT, sampling=LONG), metadata=KEY_A, timeout=1.5
    )
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_idle(served, ABORT_BOUND_S)


def test_cancel_mid_stream_aborts_and_frees_blocks(served, stub):
    """Colocated; the disaggregated twin is tests/reliability/serve/test_disaggregated.py.
    Seen failing with AsyncEngine's abort made a no-op: blocks held past ABORT_BOUND_S."""
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=LONG), metadata=KEY_A)
    first = [next(call) for _ in range(3)]
    busy = engine_stats(served)
    assert busy["num_running"] == 1 and busy["kv_blocks_free"] < busy["kv_blocks_total"]
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED and len(first) == 3
    wait_until_idle(served, ABORT_BOUND_S)


def test_timeout_s_ends_the_call_and_frees_blocks(served, stub):
    """Serve's gRPC proxy does not hand the client's deadline over and does not always
    cancel at it (docs/reliability.md), so the client also sends timeout_s, which the
    ingress enforces. Seen failing with timeout_s ignored: the call ran on to the client's
    own 20 s deadline (details without "timeout_s")."""
    req = pb.GenerateRequest(text=PROMPT, sampling=LONG, timeout_s=1.0)
    call = stub.Generate(req, metadata=KEY_A, timeout=20)
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "timeout_s" in e.value.details()
    wait_until_idle(served, ABORT_BOUND_S)


def test_duplicate_request_id_runs_both_calls(served, stub):
    """The proto says request_id need not be unique: two live calls with one id (two
    tenants) both finish. Seen failing when engine ids were f"{request_id}-{choice}": the
    second was refused ("already in use") and the first got nothing more until its deadline.
    """
    sampling = greedy(1000, ignore_eos=True)  # still running when the second call comes
    first = stub.Generate(
        pb.GenerateRequest(text=PROMPT, sampling=sampling, request_id="dup"), metadata=KEY_A
    )
    head = next(first)
    second = stub.Complete(
        pb.GenerateRequest(text="hello " + PROMPT, sampling=greedy(8), request_id="dup"),
        metadata=KEY_B,
        timeout=60,
    )
    assert second.request_id == "dup" and second.usage.completion_tokens == 8
    rest = list(first)  # still streaming, to the end
    assert head.request_id == "dup" and all(m.request_id == "dup" for m in rest)
    assert sum(len(m.token_ids) for m in [head, *rest]) == 1000
    wait_until_idle(served)


def test_overload_is_resource_exhausted_with_retry_info(served, stub):
    """Fill every engine slot and the queue in front of it; the next request is refused."""
    calls, refused = [], []

    def hold(call) -> None:
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                refused.append(e)

    def open_streams(count: int) -> None:
        for _ in range(count):
            # timeout_s bounds the streams even where Serve's gRPC proxy drops the cancel
            # below (open defect, docs/reliability.md): this test is about the refusal.
            req = pb.GenerateRequest(text=PROMPT, sampling=LONG, timeout_s=15)
            call = stub.Generate(req, metadata=KEY_A)
            calls.append(call)
            threading.Thread(target=hold, args=(call,), daemon=True).start()
            time.sleep(0.05)

    def complete_refused() -> grpc.RpcError | None:
        quick = pb.GenerateRequest(text="hi", sampling=greedy(1))
        try:  # a queued (not refused) call would wait: a short deadline ends it
            stub.Complete(quick, metadata=KEY_A, timeout=1)
        except grpc.RpcError as e:
            return e if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        return None

    try:
        open_streams(ENGINE_ONGOING + ENGINE_QUEUED + 4)
        err = None
        for _ in range(10):  # streams that end free slots: top up until a refusal
            if (err := complete_refused()) is not None:
                break
            open_streams(ENGINE_ONGOING)
        assert err is not None, "the server never refused a request"
        assert ("retry-after", "1") in err.trailing_metadata()
        assert "retry after 1s" in err.details()
        end = time.monotonic() + 10
        while not refused and time.monotonic() < end:  # a stream refused: the details say it
            open_streams(1)
            time.sleep(0.1)
        assert refused and "retry after 1s" in refused[0].details()
    finally:
        for call in calls:
            call.cancel()
    wait_until_idle(served)


def test_replica_death_is_unavailable(served, stub):
    """Last test: kills the engine replica (Serve replaces it; the module then tears down)."""
    import ray

    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=LONG), metadata=KEY_A)
    next(call)
    replica = next(
        a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineServer" in a["name"]
    )
    ray.kill(ray.get_actor(replica["name"], namespace=replica["namespace"]), no_restart=True)
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "retry" in e.value.details()
