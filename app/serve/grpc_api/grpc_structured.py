"""slimserve.v1 structured-output and tool fields <-> the HTTP request models' fields.

GenerateRequest's `structured_output` oneof, `tools`, `tool_choice` and
`parallel_tool_calls` become the same `structured_outputs` / `tools` / `tool_choice` body
fields the HTTP API takes, so both APIs validate them in one place
(app/serve/api/structured_request.py); tool calls come back as `ToolCall` messages.
"""

from __future__ import annotations

import json
from typing import Any

from app.engine.structured.tools import ToolChoice
from app.serve.api.openai_protocol import APIError
from app.serve.api.tool_calls import ToolCallStream, chat_message
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb

_MODES = {
    pb.ToolChoice.MODE_NONE: "none",
    pb.ToolChoice.MODE_AUTO: "auto",
    pb.ToolChoice.MODE_REQUIRED: "required",
}


def structured_fields(req: pb.GenerateRequest, chat: bool) -> dict[str, Any]:
    """Body fields for the request's structured output and tools."""
    out: dict[str, Any] = {}
    kind = req.WhichOneof("structured_output")
    if kind == "json_object":
        out["structured_outputs"] = {"json_object": True}
    elif kind == "json_schema":
        out["structured_outputs"] = {"json": req.json_schema}
    elif kind == "choice":
        out["structured_outputs"] = {"choice": list(req.choice.choices)}
    elif kind in ("regex", "grammar"):
        out["structured_outputs"] = {kind: getattr(req, kind)}
    has_choice = req.HasField("tool_choice")
    if (req.tools or has_choice) and not chat:
        raise APIError(400, "tools and tool_choice need chat input", param="tools")
    if req.tools:
        out["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if has_choice:
        out["tool_choice"] = _tool_choice(req.tool_choice)
    if req.HasField("parallel_tool_calls"):
        out["parallel_tool_calls"] = req.parallel_tool_calls
    return out


def _tool(i: int, tool: pb.Tool) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": tool.name, "description": tool.description}
    if tool.parameters_json:
        try:
            fn["parameters"] = json.loads(tool.parameters_json)
        except json.JSONDecodeError as e:
            where = f"tools[{i}].parameters_json"
            raise APIError(400, f"{where} is not valid JSON: {e}", param=where) from None
    return {"type": "function", "function": fn}


def _tool_choice(choice: pb.ToolChoice) -> Any:
    if choice.WhichOneof("choice") == "function":
        return {"type": "function", "function": {"name": choice.function}}
    mode = _MODES.get(choice.mode)
    if mode is None:
        raise APIError(400, "tool_choice: set mode or function", param="tool_choice")
    return mode


def _calls_pb(calls: list[dict[str, Any]]) -> list[pb.ToolCall]:
    return [
        pb.ToolCall(
            index=c.get("index", i),
            id=c.get("id", ""),
            name=c.get("function", {}).get("name", ""),
            arguments=c.get("function", {}).get("arguments", ""),
        )
        for i, c in enumerate(calls)
    ]


def choice_tool_calls(text: str, reason: str | None, tools: ToolChoice | None):
    """(ToolCall messages, finish reason) of a finished choice."""
    message, reason = chat_message(text, reason, tools)
    return _calls_pb(message.get("tool_calls") or []), reason


class StreamToolCalls:
    """Streamed tool-call deltas for a Generate stream (None when tools do not constrain)."""

    def __init__(self, tools: ToolChoice):
        self._stream = ToolCallStream(tools)

    def delta(self, index: int, text: str, reason: str | None):
        body, reason = self._stream.delta(index, text, reason)
        return _calls_pb(body.get("tool_calls") or []), reason
