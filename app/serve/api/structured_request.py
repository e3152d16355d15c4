"""Request fields for structured outputs and tools -> one StructuredOutputSpec (or None).

The HTTP bodies (and gRPC, which is converted to them) may ask for a constrained output in
three ways; at most one may constrain a request:
- OpenAI `response_format`: {"type": "text" | "json_object" | "json_schema", ...};
- vLLM-style `structured_outputs`: exactly one of `choice`, `regex`, `json`, `grammar`
  (or `json_object: true`);
- `tools` + `tool_choice` "required" or a named function (app/engine/structured/tools.py).
Every spec is checked here (its grammar built), so a bad schema is a 400 naming the problem
before any replica sees the request.
"""

from __future__ import annotations

from typing import Any

from app.engine.structured import StructuredOutputError, StructuredOutputSpec, check_spec
from app.engine.structured.tools import (
    ToolChoice,
    ToolFunction,
    parse_tool_choice,
    parse_tools,
    tool_choice_spec,
)


class StructuredFieldError(ValueError):
    """A bad structured-output or tool field; `param` names it (becomes a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


_SO_KINDS = {
    "choice": StructuredOutputSpec.choice,
    "regex": StructuredOutputSpec.regex,
    "json": StructuredOutputSpec.json_schema,
    "grammar": StructuredOutputSpec.grammar,
}


def response_format_spec(rf: dict[str, Any] | None) -> StructuredOutputSpec | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _bad("response_format.json_schema.schema is required", "response_format")
        return _spec(lambda: StructuredOutputSpec.json_schema(js["schema"]), "response_format")
    raise _bad(
        f'response_format.type must be "text", "json_object" or "json_schema", not {kind!r}',
        "response_format",
    )


def structured_outputs_spec(so: dict[str, Any] | None) -> StructuredOutputSpec | None:
    if so is None:
        return None
    unknown = sorted(set(so) - set(_SO_KINDS) - {"json_object"})
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]} is not supported", "structured_outputs")
    asked = [k for k in _SO_KINDS if so.get(k) is not None]
    if so.get("json_object"):
        asked.append("json_object")
    if len(asked) != 1:
        raise _bad(
            "structured_outputs: set exactly one of choice, regex, json, grammar, json_object",
            "structured_outputs",
        )
    kind = asked[0]
    if kind == "json_object":
        return StructuredOutputSpec.json_object()
    return _spec(lambda: _SO_KINDS[kind](so[kind]), f"structured_outputs.{kind}")


def tools_and_choice(
    raw_tools: list[dict[str, Any]] | None, raw_choice: Any, parallel: bool | None = None
) -> tuple[list[ToolFunction], ToolChoice]:
    if raw_tools is None and raw_choice not in (None, "none"):
        raise _bad("tool_choice needs tools", "tool_choice")
    try:
        tools = parse_tools(raw_tools or [])
    except StructuredOutputError as e:
        raise _bad(str(e), "tools") from None
    try:
        return tools, parse_tool_choice(raw_choice, bool(tools), parallel is not False)
    except StructuredOutputError as e:
        raise _bad(str(e), "tool_choice") from None


def request_spec(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    tools: list[ToolFunction] = (),
    choice: ToolChoice | None = None,
) -> StructuredOutputSpec | None:
    """The one spec a request asks for; 400 if it asks for two or for a bad one."""
    choice = choice or ToolChoice("none")
    asked = {
        "response_format": response_format_spec(response_format),
        "structured_outputs": structured_outputs_spec(structured_outputs),
        "tool_choice": _spec(lambda: tool_choice_spec(list(tools), choice), "tool_choice"),
    }
    given = [(where, spec) for where, spec in asked.items() if spec is not None]
    if len(given) > 1:
        names = " and ".join(where for where, _ in given)
        raise _bad(f"{names} both constrain the output; use one", given[0][0])
    if not given:
        return None
    where, spec = given[0]
    _spec(lambda: check_spec(spec), where)
    return spec


def _spec(make, param: str):
    try:
        return make()
    except StructuredOutputError as e:
        raise _bad(f"{param}: {e}", param) from None


def _bad(message: str, param: str) -> StructuredFieldError:
    return StructuredFieldError(message, param)
