"""Tool calls as structured outputs: the grammar for `tool_choice` and parsing the result.

- "none" / "auto": no grammar. The chat template gets the tools (where it renders them) and
  the output is text; slimserve does not guess tool calls out of free text.
- a named function: the output is that function's arguments, generated under its
  `parameters` JSON schema.
- "required": the output is a JSON array of one or more {"name": ..., "arguments": {...}}
  objects, each name one of the tools and its arguments valid under that tool's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.engine.structured.backend import StructuredOutputError
from app.engine.structured.spec import StructuredOutputSpec

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolFunction:
    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(_ANY_OBJECT))
    description: str = ""


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the function, when mode == "named"
    parallel: bool = True  # "required" may make several calls (OpenAI parallel_tool_calls)

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def tool_choice_spec(tools: list[ToolFunction], choice: ToolChoice) -> StructuredOutputSpec | None:
    """The grammar that makes the output a call (None for "none" and "auto")."""
    if not choice.constrained:
        return None
    if not tools:
        raise StructuredOutputError(f'tool_choice "{choice.mode}" needs at least one tool')
    if choice.mode == "named":
        tool = next((t for t in tools if t.name == choice.name), None)
        if tool is None:
            known = ", ".join(t.name for t in tools)
            raise StructuredOutputError(
                f"tool_choice names function {choice.name!r}, which is not among the tools "
                f"({known})"
            )
        return StructuredOutputSpec.json_schema(_object_schema(tool))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _object_schema(t)},
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "minItems": 1, "items": items}
    return StructuredOutputSpec.json_schema(array if choice.parallel else {**array, "maxItems": 1})


def _object_schema(tool: ToolFunction) -> dict[str, Any]:
    # OpenAI function parameters are an object; a schema without a type gets one.
    return tool.parameters if "type" in tool.parameters else {**tool.parameters, **_ANY_OBJECT}


def parse_tool_calls(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls in a finished constrained output (the grammar guarantees the shape)."""
    if choice.mode == "named":
        return [ToolCall(choice.name or "", _compact(json.loads(text)))]
    if choice.mode == "required":
        return [ToolCall(c["name"], _compact(c["arguments"])) for c in json.loads(text)]
    return []


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_tools(raw: list[dict[str, Any]]) -> list[ToolFunction]:
    """OpenAI's `tools` list -> ToolFunction, with errors naming the bad entry."""
    tools, seen = [], set()
    for i, entry in enumerate(raw):
        fn = entry.get("function") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("type") != "function"
            or not isinstance(fn, dict)
        ):
            raise StructuredOutputError(
                f'tools[{i}] must be {{"type": "function", "function": {{...}}}}'
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise StructuredOutputError(f"tools[{i}].function.name must be 1 to 64 characters")
        if name in seen:
            raise StructuredOutputError(f"tools[{i}]: function {name!r} is defined twice")
        params = fn.get("parameters", _ANY_OBJECT)
        if not isinstance(params, dict):
            raise StructuredOutputError(
                f"tools[{i}].function.parameters must be a JSON schema object"
            )
        seen.add(name)
        tools.append(ToolFunction(name, params, str(fn.get("description") or "")))
    return tools


def parse_tool_choice(raw: Any, has_tools: bool, parallel: bool = True) -> ToolChoice:
    """OpenAI's `tool_choice`; the default is "auto" with tools and "none" without."""
    if raw is None:
        return ToolChoice("auto" if has_tools else "none", parallel=parallel)
    if raw in ("none", "auto", "required"):
        return ToolChoice(raw, parallel=parallel)
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = (raw.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return ToolChoice("named", name, parallel)
    raise StructuredOutputError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )
