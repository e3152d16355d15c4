"""Tool calls in OpenAI's response shape, whole (final_body) and as streamed deltas.

With tool_choice "required" or a named function the engine generated the call under a
grammar (app/engine/structured/tools.py); this turns its text into `tool_calls`:
- named: the text is the arguments; streamed as they come (the first delta carries the
  call's id and name, later ones append to `function.arguments`);
- required: the text is a JSON array of {"name", "arguments"}; the calls are sent when the
  array is complete (one delta per call), since a name is known only once parsed.
A finished call ends with finish_reason "tool_calls"; a call cut off by max_tokens ends
"length" (named: the partial arguments; required: the raw text as content).
"""

from __future__ import annotations

import uuid
from typing import Any

from app.engine.structured.tools import ToolChoice, parse_tool_calls


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(index: int, name: str, arguments: str) -> dict[str, Any]:
    fn = {"name": name, "arguments": arguments}
    return {"index": index, "id": _call_id(), "type": "function", "function": fn}


def chat_message(text: str, reason: str | None, choice: ToolChoice | None):
    """(message, finish_reason) of a finished chat choice."""
    if choice is None or not choice.constrained:
        return {"role": "assistant", "content": text}, reason
    if reason == "stop":
        calls = [
            _call(i, c.name, c.arguments) for i, c in enumerate(parse_tool_calls(text, choice))
        ]
        return _tool_message(calls), "tool_calls"
    if choice.mode == "named":  # cut off: what was generated of the arguments
        return _tool_message([_call(0, choice.name or "", text)]), reason
    return {"role": "assistant", "content": text}, reason


def _tool_message(calls: list[dict[str, Any]]) -> dict[str, Any]:
    for c in calls:
        del c["index"]  # a whole message's calls carry no stream index
    return {"role": "assistant", "content": None, "tool_calls": calls}


class ToolCallStream:
    """Per-choice state turning streamed text deltas into tool_calls deltas."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self._text: dict[int, str] = {}  # choice index -> text so far
        self._opened: set[int] = set()

    def delta(self, index: int, text: str, reason: str | None):
        """(delta body, finish_reason) for one streamed piece of choice `index`."""
        self._text[index] = self._text.get(index, "") + text
        if self.choice.mode == "named":
            return self._named(index, text, reason)
        if reason is None:
            return {}, None
        whole = self._text.pop(index)
        if reason != "stop":
            return {"content": whole}, reason
        calls = parse_tool_calls(whole, self.choice)
        return {"tool_calls": [_call(i, c.name, c.arguments) for i, c in enumerate(calls)]}, (
            "tool_calls"
        )

    def _named(self, index: int, text: str, reason: str | None):
        if index not in self._opened:
            self._opened.add(index)
            call = _call(0, self.choice.name or "", text)
        elif text:
            call = {"index": 0, "function": {"arguments": text}}
        else:
            call = None
        body = {"tool_calls": [call]} if call is not None else {}
        return body, ("tool_calls" if reason == "stop" else reason)
