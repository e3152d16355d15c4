"""Tokenizer: a Hugging Face tokenizer.json through `tokenizers`, or raw bytes as a fallback.

Chat templates are rendered with jinja2 from tokenizer_config.json, as transformers does.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialized as a dict
        return value.get("content")
    return value


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class Tokenizer:
    def __init__(self, hf: HFTokenizer | None, config: dict[str, Any], eos_ids: tuple[int, ...]):
        self.hf = hf
        self.config = config
        self.bos_token = _token_str(config.get("bos_token"))
        self.eos_token = _token_str(config.get("eos_token"))
        self.eos_token_ids = eos_ids
        self.chat_template = config.get("chat_template")
        self._template = None
        self._literal: HFTokenizer | None = None  # encodes special-token text as plain text
        added = hf.get_added_tokens_decoder().values() if hf is not None else ()
        self.control_strings = tuple(t.content for t in added)  # specials and added tokens

    @classmethod
    def from_path(cls, path: str, eos_ids: tuple[int, ...] = ()) -> Tokenizer:
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_file):
            with open(cfg_file) as f:
                config = json.load(f)
        tok_file = os.path.join(path, "tokenizer.json")
        hf = HFTokenizer.from_file(tok_file) if os.path.exists(tok_file) else None
        tok = cls(hf, config, eos_ids)
        if not eos_ids and hf is not None and tok.eos_token:
            eos = hf.token_to_id(tok.eos_token)
            tok.eos_token_ids = () if eos is None else (eos,)
        return tok

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True) if self.hf else 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is None:
            return list(text.encode("utf-8"))
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """tools: OpenAI tool definitions, given to templates that render them (as
        transformers does); a template without tool support ignores them."""
        if not self.chat_template:
            # No template shipped: a plain "role: content" transcript.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as e:
                raise ChatTemplateError(f"invalid chat template: {e}") from e
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:  # e.g. a field the template needs is missing: 400
            raise ChatTemplateError(
                f"the chat template cannot render this conversation: {e}"
            ) from e

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The conversation's token ids; only the template's own markers become specials.

        A message that types "<|system|>" or "<|end|>" gets those characters as text, not
        the control tokens (no role injection). Messages without such text take the plain
        path, so their ids are exactly the rendered template's.
        """
        fields = [{k: v for k, v in m.items() if k != "content"} for m in messages]
        if any(self._has_control(text) for text in _strings([fields, tools])):
            # These are rendered by the template itself, with no marker to keep them literal.
            raise ChatTemplateError(
                "tool_calls, tool_call_id and tool definitions must not hold special-token "
                "text (such as a turn marker): the chat template would render it as control "
                "tokens"
            )
        contents = [m.get("content") for m in messages]
        if not any(isinstance(c, str) and self._has_control(c) for c in contents):
            # The template already carries BOS where the model wants it.
            return self.encode(
                self.apply_chat_template(messages, tools=tools), add_special_tokens=False
            )
        return self._encode_chat_literal(messages, tools)

    def _has_control(self, text: str) -> bool:
        return any(s in text for s in self.control_strings)

    def _encode_chat_literal(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render with a marker per content, then encode template text with special-token
        parsing on and each content with it off."""
        marked = [
            {**m, "content": _MARK.format(i)} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        pieces = _MARK_RE.split(self.apply_chat_template(marked, tools=tools))
        texts = [m.get("content") for m in messages]
        # split() alternates: template text, content index, template text, ...
        rendered = "".join(p if k % 2 == 0 else texts[int(p)] for k, p in enumerate(pieces))
        if rendered != self.apply_chat_template(messages, tools=tools):
            raise ChatTemplateError(
                "message content holds special-token text and the chat template rewrites "
                "content, so it cannot be kept as plain text"
            )
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            elif texts[int(piece)]:
                ids += (
                    self._literal_tokenizer()
                    .encode(texts[int(piece)], add_special_tokens=False)
                    .ids
                )
        return ids

    def _literal_tokenizer(self) -> HFTokenizer:
        if self._literal is None:
            assert self.hf is not None
            literal = HFTokenizer.from_str(self.hf.to_str())
            literal.encode_special_tokens = True  # special-token text is split like any text
            self._literal = literal
        return self._literal


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, dict keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


# A content marker no template produces by itself: private-use characters around an index.
_MARK = "\ue000{}\ue001"
_MARK_RE = re.compile("\ue000(\\d+)\ue001")
