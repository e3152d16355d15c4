"""gRPC messages -> the HTTP request models, and failures -> status codes (no Ray cluster)."""

import grpc
import pytest
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from app.engine.request import OverloadedError, RequestDelta
from app.serve.api.openai_protocol import APIError, ChatCompletionRequest, CompletionRequest
from app.serve.grpc_api.grpc_convert import (
    MalformedRequest,
    UsageCounter,
    call_timeout_s,
    conversation,
    grpc_error,
    http_body,
    parsed,
    stream_message,
)
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb


def test_unset_sampling_fields_take_the_http_defaults():
    body = http_body(pb.GenerateRequest(text="hi"), "tiny")
    assert isinstance(body, CompletionRequest) and body.model == "tiny"
    want = CompletionRequest(model="tiny", prompt="hi").to_params()
    assert body.to_params() == want


def test_set_fields_reach_the_engine_params():
    sampling = pb.SamplingParams(
        max_tokens=7, temperature=0, top_k=5, n=2, seed=3, stop=["x"], logprobs=0
    )
    params = http_body(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=sampling), "m"
    )
    params = params.to_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.n) == (7, 0, 5, 2)
    assert (params.seed, params.stop, params.logprobs) == (3, ["x"], 0)


def test_chat_logprobs_map_to_top_logprobs():
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    req = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(logprobs=3))
    body = http_body(req, "m")
    assert isinstance(body, ChatCompletionRequest) and body.to_params().logprobs == 3
    bad = pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(logprobs=30))
    with pytest.raises(APIError, match=r"^sampling\.logprobs"):
        http_body(bad, "m")


# A multi-turn tool conversation, as the HTTP API takes it and as gRPC spells it.
TOOL_TURNS = [
    {"role": "user", "content": "weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
        ],
    },  # fmt: skip
    {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
]
TOOL_CHAT = pb.Chat(
    messages=[
        pb.ChatMessage(role="user", content="weather in Paris?"),
        pb.ChatMessage(
            role="assistant",
            tool_calls=[
                pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
            ],
        ),
        pb.ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ]
)


def test_tool_turns_reach_the_template_as_over_http():
    """An assistant turn's tool_calls and a tool turn's tool_call_id map to the HTTP
    message JSON, for Generate/Complete (http_body) and Tokenize (conversation). Seen
    failing before the fields existed: gRPC turns carried role and content only."""
    want = ChatCompletionRequest(model="m", messages=TOOL_TURNS).conversation()
    assert want[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert http_body(pb.GenerateRequest(chat=TOOL_CHAT), "m").conversation() == want
    assert conversation(TOOL_CHAT) == want


def test_call_timeout_is_the_clients_capped_by_the_servers():
    assert call_timeout_s(pb.GenerateRequest(), 300.0) == 300.0
    assert call_timeout_s(pb.GenerateRequest(timeout_s=0), 300.0) == 300.0
    assert call_timeout_s(pb.GenerateRequest(timeout_s=2.5), 300.0) == 2.5
    assert call_timeout_s(pb.GenerateRequest(timeout_s=1e9), 300.0) == 300.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(APIError, match="^timeout_s"):
            call_timeout_s(pb.GenerateRequest(timeout_s=bad), 300.0)


@pytest.mark.parametrize(
    "exc,code",
    [
        (BackPressureError(num_queued_requests=3, max_queued_requests=3), "RESOURCE_EXHAUSTED"),
        (OverloadedError("queue full"), "RESOURCE_EXHAUSTED"),
        (RayActorError(), "UNAVAILABLE"),
        (DeploymentUnavailableError(None), "UNAVAILABLE"),
        (TimeoutError(), "DEADLINE_EXCEEDED"),
        (ValueError("max_tokens must be >= 1"), "INVALID_ARGUMENT"),
        (APIError(404, "no such model"), "NOT_FOUND"),
        (APIError(401, "no key"), "UNAUTHENTICATED"),
        (KeyError("bug"), "INTERNAL"),  # only the server's own faults
    ],
)
def test_failures_map_to_status_codes(exc, code):
    error = grpc_error(exc, retry_after_s=2)
    assert error.code == getattr(grpc.StatusCode, code)
    retryable = code in ("RESOURCE_EXHAUSTED", "UNAVAILABLE")
    assert (("retry-after", "2") in error.trailers) == retryable
    assert ("retry after 2s" in error.message) == retryable


def test_malformed_request_is_invalid_argument():
    with pytest.raises(APIError) as e:
        parsed(MalformedRequest("String field had bad UTF-8"))
    assert e.value.status == 400 and "UTF-8" in e.value.message


def test_usage_goes_on_the_last_delta_of_the_last_choice():
    counter = UsageCounter(num_prompt=5, num_choices=2)
    deltas = [
        RequestDelta("r", 0, [1], "a", num_cached_tokens=16),
        RequestDelta("r", 1, [2], "b", num_cached_tokens=16),
        RequestDelta("r", 0, [3], "c", finished=True, finish_reason="stop"),
        RequestDelta("r", 1, [4], "d", finished=True, finish_reason="length"),
    ]
    assert [counter.add(d) for d in deltas] == [False, False, False, True]
    usage = counter.usage()
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (5, 4, 16)
    last = stream_message(deltas[-1], "r")
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and list(last.token_ids) == [4]
    assert stream_message(deltas[0], "r").finish_reason == pb.FINISH_REASON_UNSPECIFIED
