"""Structured outputs and tool calls through the official `openai` client against a real
local Serve app on the default model, colocated and disaggregated.

Validity is checked independently (json + jsonschema, re.fullmatch); the default model is
random-ish, so only the grammar makes its outputs valid: test_unconstrained_output_is_not_json
in test_engine_structured.py is the control, and making the engine's mask a no-op fails the
engine-level validity tests (seen there; this file drives the same engine path).
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from serve.apps import running_app, tiny_serve_args

from app.assets import default_model_path
from tests.structured.schemas import PERSON, TIME_TOOL, WEATHER_TOOL

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TOOLS = [WEATHER_TOOL, TIME_TOOL]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def client(request, ray_session):
    args = tiny_serve_args(
        default_model_path(),
        mode=request.param,
        # disaggregated: every prompt through the prefill replica, so the decode replica's
        # grammar replays the prefill's first token (a short prompt prefilled on its decode
        # replica runs as colocated does)
        local_prefill_max_tokens=0,
        engine={"dtype": "float32", "kv_cache_memory_bytes": 24 << 20},
    )
    with running_app(ray_session, args) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, text, **kw):
    messages = [{"role": "user", "content": text}]
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def test_json_schema_outputs_validate(client):
    """50 prompts with a nested schema: every finished output parses and validates."""

    def one(i):
        kw = {"max_tokens": 200, "seed": i, "response_format": PERSON_FORMAT}
        return chat(client, f"Describe person number {i}.", **kw).choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(one, range(50)))
    done = [c for c in choices if c.finish_reason == "stop"]
    assert len(done) >= 40, [c.finish_reason for c in choices]
    for c in done:
        try:
            jsonschema.validate(json.loads(c.message.content), PERSON)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{c.message.content!r}: {e}") from None
    assert {c.finish_reason for c in choices} <= {"stop", "length"}


def test_choice_regex_grammar_and_json_object(client):
    labels = ["positive", "negative", "neutral"]
    r = client.completions.create(
        model="tiny",
        prompt="Sentiment:",
        max_tokens=10,
        n=3,
        seed=1,
        extra_body={"structured_outputs": {"choice": labels}},
    )
    assert all(c.text in labels and c.finish_reason == "stop" for c in r.choices)
    pattern = r"\d{4}-\d{2}-\d{2}"
    r = chat(
        client, "A date:", max_tokens=20, extra_body={"structured_outputs": {"regex": pattern}}
    )
    assert re.fullmatch(pattern, r.choices[0].message.content)
    grammar = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'
    r = chat(
        client,
        "List:",
        max_tokens=30,
        seed=2,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    if r.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\[[a-c](,[a-c])*\]", r.choices[0].message.content)
    r = chat(client, "JSON:", max_tokens=40, seed=3, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_named_tool_call_arguments_validate(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = chat(
            client, "Weather in Paris?", tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=80
        )
        c = r.choices[0]
        assert c.message.content is None and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert call.id.startswith("call_")
        if c.finish_reason == "tool_calls":
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        else:
            assert c.finish_reason == "length"


def test_required_tool_calls_validate(client):
    """Each call names one of the tools and its arguments validate under that tool.
    (parallel_tool_calls=False: one call; the default model repeats calls forever.)"""
    finished = 0
    for seed in range(4):
        kw = {"tool_choice": "required", "parallel_tool_calls": False, "seed": seed}
        c = chat(client, "Use a tool.", tools=TOOLS, max_tokens=120, **kw).choices[0]
        if c.finish_reason != "tool_calls":
            assert c.finish_reason == "length" and not c.message.tool_calls
            continue
        finished += 1
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert finished >= 2


def test_auto_and_none_return_text(client):
    """tool_choice auto: the default model's template does not render tools and the model
    has no call format, so the answer is text (docs/structured_outputs.md)."""
    for mode in ("auto", "none"):
        c = chat(client, "Hi", tools=TOOLS, tool_choice=mode, max_tokens=5).choices[0]
        assert isinstance(c.message.content, str) and not c.message.tool_calls


def test_streamed_output_concatenates_to_the_same_text(client):
    kw = {"max_tokens": 120, "temperature": 0, "response_format": PERSON_FORMAT}
    whole = chat(client, "A person:", **kw).choices[0]
    chunks = list(chat(client, "A person:", stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"max_tokens": 80, "temperature": 0, "tools": TOOLS, "tool_choice": choice}
    whole = chat(client, "Weather?", **kw).choices[0]
    chunks = [c.choices[0] for c in chat(client, "Weather?", stream=True, **kw) if c.choices]
    calls = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    args = "".join(tc.function.arguments or "" for tc in calls)
    assert args == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].finish_reason == whole.finish_reason


@pytest.mark.parametrize(
    "kw, words",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 7}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"extra_body": {"structured_outputs": {"regex": "(?<=a)b"}}}, "Lookbehind"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "exactly one"),
        ({"extra_body": {"structured_outputs": {"xml": "a"}}}, "structured_outputs.xml"),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"regex": "a"}},
            },
            "use one",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ],
)
def test_bad_requests_are_400_naming_the_problem(client, kw, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "x", max_tokens=5, **kw)
    assert words in str(e.value)
