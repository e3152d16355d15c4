"""Structured outputs and tool calls through a real grpcio client on Serve's gRPC proxy
(colocated default model): the GenerateRequest `structured_output` oneof, tools and
tool_choice, validated like the HTTP API (INVALID_ARGUMENT naming the problem).

Seen failing: with grpc_structured.structured_fields returning {} (the oneof ignored) the
bad-request cases and the choice test failed (8 tests)."""

import json
import re

import grpc
import jsonschema
import pytest
from serve.apps import tiny_serve_args

from app.assets import default_model_path
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc
from tests.grpc.grpc_app import grpc_app
from tests.structured.schemas import PERSON, WEATHER_TOOL

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "slimserve-grpc-structured"
META = (("application", APP),)
WEATHER = WEATHER_TOOL["function"]
TOOL = pb.Tool(name=WEATHER["name"], parameters_json=json.dumps(WEATHER["parameters"]))


@pytest.fixture(scope="module")
def stub(ray_session):
    args = tiny_serve_args(default_model_path(), engine={"dtype": "float32"}, mode="colocated")
    with grpc_app(ray_session, args, APP, META) as (channel, _http):
        yield generation_pb2_grpc.GenerationStub(channel)


def request(**kw) -> pb.GenerateRequest:
    sampling = kw.pop("sampling", pb.SamplingParams(max_tokens=200, seed=1))
    if "chat" not in kw and "text" not in kw:
        kw["text"] = "A person:"
    return pb.GenerateRequest(sampling=sampling, **kw)


def test_json_schema_choice_and_regex(stub):
    r = stub.Complete(request(json_schema=json.dumps(PERSON)), metadata=META, timeout=120)
    c = r.choices[0]
    if c.finish_reason == pb.FINISH_REASON_STOP:
        jsonschema.validate(json.loads(c.text), PERSON)
    else:
        assert c.finish_reason == pb.FINISH_REASON_LENGTH
    labels = ["red", "green"]
    sampling = pb.SamplingParams(max_tokens=10, n=4, seed=2)
    r = stub.Complete(
        request(choice=pb.Choices(choices=labels), sampling=sampling), metadata=META, timeout=60
    )
    assert [c.text in labels for c in r.choices] == [True] * 4
    r = stub.Complete(request(regex=r"[a-f]{3}\d"), metadata=META, timeout=60)
    assert re.fullmatch(r"[a-f]{3}\d", r.choices[0].text)


def test_stream_concatenates_to_the_complete_text(stub):
    greedy = pb.SamplingParams(max_tokens=120, temperature=0)
    req = request(json_schema=json.dumps(PERSON), sampling=greedy)
    whole = stub.Complete(req, metadata=META, timeout=120).choices[0]
    parts = list(stub.Generate(req, metadata=META, timeout=120))
    assert "".join(p.text for p in parts) == whole.text
    assert parts[-1].finish_reason == whole.finish_reason


def test_named_tool_call(stub):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Weather in Oslo?")])
    choice = pb.ToolChoice(function="get_weather")
    finished = 0
    for seed in range(3):
        sampling = pb.SamplingParams(max_tokens=80, seed=seed)
        req = request(chat=chat, tools=[TOOL], tool_choice=choice, sampling=sampling)
        c = stub.Complete(req, metadata=META, timeout=60).choices[0]
        assert len(c.tool_calls) == 1 and c.tool_calls[0].name == "get_weather"
        assert c.tool_calls[0].id.startswith("call_")
        if c.finish_reason == pb.FINISH_REASON_TOOL_CALLS:
            jsonschema.validate(json.loads(c.tool_calls[0].arguments), WEATHER["parameters"])
            finished += 1
        else:
            assert c.finish_reason == pb.FINISH_REASON_LENGTH
    assert finished >= 1
    parts = list(stub.Generate(req, metadata=META, timeout=60))
    calls = [tc for p in parts for tc in p.tool_calls]
    assert calls[0].name == "get_weather" and calls[0].id
    assert "".join(tc.arguments for tc in calls) == c.tool_calls[0].arguments


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"json_schema": '{"type": "nope"}'}, 'Unsupported type "nope"'),
        ({"json_schema": "{"}, "not valid JSON"),
        ({"regex": "(?<=x)y"}, "Lookbehind"),
        ({"grammar": "root ::= other"}, 'Rule "other"'),
        ({"choice": pb.Choices()}, "non-empty list"),
        ({"tools": [TOOL]}, "tools and tool_choice need chat input"),
        (
            {
                "chat": pb.Chat(messages=[pb.ChatMessage(role="user", content="x")]),
                "tools": [TOOL],
                "tool_choice": pb.ToolChoice(function="nope"),
            },
            "'nope'",
        ),
    ],
)
def test_bad_structured_requests_are_invalid_argument(stub, kw, words):
    for call in (stub.Complete, lambda *a, **k: list(stub.Generate(*a, **k))):
        with pytest.raises(grpc.RpcError) as e:
            call(request(**kw), metadata=META, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in e.value.details()
