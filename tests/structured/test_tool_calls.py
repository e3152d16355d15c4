"""Tool-call grammars (app/engine/structured/tools.py) and OpenAI-shaped tool_calls, whole
and streamed (app/serve/api/tool_calls.py), without a model."""

import json

import jsonschema
import pytest

from app.engine.structured import StructuredOutputError
from app.engine.structured.tools import (
    ToolChoice,
    parse_tool_choice,
    parse_tools,
    tool_choice_spec,
)
from app.serve.api.tool_calls import ToolCallStream, chat_message
from tests.structured.schemas import TIME_TOOL, WEATHER_TOOL

TOOLS = parse_tools([WEATHER_TOOL, TIME_TOOL])
CALL = {"city": "Oslo", "unit": "celsius", "days": 2}


def test_choice_specs():
    assert tool_choice_spec(TOOLS, ToolChoice("auto")) is None
    assert tool_choice_spec(TOOLS, ToolChoice("none")) is None
    named = tool_choice_spec(TOOLS, ToolChoice("named", "get_weather"))
    assert named.schema() == WEATHER_TOOL["function"]["parameters"]
    required = tool_choice_spec(TOOLS, ToolChoice("required")).schema()
    good = [
        {"name": "get_weather", "arguments": CALL},
        {"name": "get_time", "arguments": {"zone": "UTC"}},
    ]
    jsonschema.validate(good, required)
    for bad in (
        [],
        [{"name": "get_time", "arguments": CALL}],
        [{"name": "other", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = tool_choice_spec(TOOLS, ToolChoice("required", parallel=False)).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)
    with pytest.raises(StructuredOutputError, match="not among the tools"):
        tool_choice_spec(TOOLS, ToolChoice("named", "nope"))


@pytest.mark.parametrize(
    "raw, words",
    [
        ([{"type": "function"}], "tools[0] must be"),
        ([{"type": "function", "function": {"name": "a" * 65}}], "1 to 64"),
        ([WEATHER_TOOL, WEATHER_TOOL], "defined twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON schema object"),
    ],
)
def test_bad_tools(raw, words):
    with pytest.raises(StructuredOutputError, match=words.replace("[", r"\[").replace("]", r"\]")):
        parse_tools(raw)


def test_tool_choice_forms():
    assert parse_tool_choice(None, True).mode == "auto"
    assert parse_tool_choice(None, False).mode == "none"
    named = parse_tool_choice({"type": "function", "function": {"name": "f"}}, True)
    assert (named.mode, named.name) == ("named", "f")
    with pytest.raises(StructuredOutputError):
        parse_tool_choice("sometimes", True)


def test_whole_message_and_finish_reasons():
    named = ToolChoice("named", "get_weather")
    message, reason = chat_message(json.dumps(CALL), "stop", named)
    assert reason == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps(CALL)}
    assert call["id"].startswith("call_") and call["type"] == "function"
    message, reason = chat_message('{"city": "Os', "length", named)
    assert (
        reason == "length" and message["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'
    )
    required = ToolChoice("required")
    text = json.dumps([{"name": "get_time", "arguments": {"zone": "CET"}}] * 2)
    message, reason = chat_message(text, "stop", required)
    assert reason == "tool_calls" and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_time",
        "get_time",
    ]
    message, reason = chat_message("[{", "length", required)
    assert message == {"role": "assistant", "content": "[{"} and reason == "length"
    assert chat_message("hi", "stop", ToolChoice("auto"))[0]["content"] == "hi"


def test_streamed_named_call_concatenates_to_the_arguments():
    stream = ToolCallStream(ToolChoice("named", "get_weather"))
    pieces = ['{"city"', ': "Oslo", ', "", '"unit": "celsius", "days": 2}']
    out = [
        stream.delta(0, p, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)
    ]
    first = out[0][0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather"
    assert out[2][0] == {}  # an empty text delta carries no call delta
    args = "".join(b["tool_calls"][0]["function"]["arguments"] for b, _ in out if b)
    assert json.loads(args) == CALL and out[-1][1] == "tool_calls"


def test_streamed_required_calls_come_when_complete():
    stream = ToolCallStream(ToolChoice("required"))
    text = json.dumps([{"name": "get_time", "arguments": {"zone": "UTC"}}])
    assert stream.delta(1, text[:10], None) == ({}, None)
    body, reason = stream.delta(1, text[10:], "stop")
    assert reason == "tool_calls" and body["tool_calls"][0]["function"]["name"] == "get_time"
    assert body["tool_calls"][0]["index"] == 0
