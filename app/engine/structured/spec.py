"""What a request asks its output to be: StructuredOutputSpec, plus building its grammar.

A spec is a small frozen value (hashable, picklable across replicas): the kind and the
source text. `key` names the compiled grammar in the compiler's cache, so two requests with
the same schema share one compilation.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from app.engine.structured.backend import StructuredOutputError, clean_message, xgrammar

KINDS = ("json_object", "json_schema", "choice", "regex", "grammar")
MAX_SOURCE_CHARS = 1 << 20  # a schema or grammar larger than 1 MiB is refused, not compiled
JSON_SEPARATORS = (", ", ": ")  # item, key-value: as json.dumps prints them


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """kind: one of KINDS. source: the JSON schema as compact JSON text (json_schema), the
    regex (regex), the EBNF grammar with a `root` rule (grammar), "" for json_object.
    choices: the allowed outputs (choice)."""

    kind: str
    source: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}")
        if len(self.source) > MAX_SOURCE_CHARS:
            raise StructuredOutputError(
                f"the {self.kind} is {len(self.source)} characters; at most "
                f"{MAX_SOURCE_CHARS} are allowed"
            )
        if self.kind == "choice":
            if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings")
        elif self.kind != "json_object" and (
            not isinstance(self.source, str) or not self.source.strip()
        ):
            raise StructuredOutputError(f"the {self.kind} is empty")

    # --- constructors -------------------------------------------------------------
    @classmethod
    def json_object(cls) -> StructuredOutputSpec:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str | bool) -> StructuredOutputSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError("a JSON schema must be a JSON object")
        # Key order is kept: properties are generated in the order the schema declares them.
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutputSpec:
        if isinstance(choices, str) or not isinstance(choices, list | tuple):
            raise StructuredOutputError("choice must be a list of strings")
        return cls("choice", choices=tuple(choices))

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputSpec:
        return cls("regex", _text(pattern, "regex"))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutputSpec:
        return cls("grammar", _text(ebnf, "grammar"))

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.kind, self.source, self.choices)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema (json_schema only), e.g. for validating outputs."""
        return json.loads(self.source) if self.kind == "json_schema" else None

    def build_grammar(self):
        """The xgrammar Grammar (tokenizer-independent); StructuredOutputError if it is bad.

        JSON has no free whitespace (a model cannot then spend its max_tokens on spaces)
        and json.dumps's separators ", " and ": ", named here because xgrammar's default
        for them changed between 0.2.8 and 0.2.9.
        """
        xgr = xgrammar()
        try:
            if self.kind in ("json_object", "json_schema"):
                source = '{"type": "object"}' if self.kind == "json_object" else self.source
                strict = self.kind == "json_schema"  # json_object: any properties
                grammar = xgr.Grammar.from_json_schema(
                    source, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=strict
                )
                return _no_raw_control_chars(xgr, grammar)
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.source)
            if self.kind == "grammar":
                return xgr.Grammar.from_ebnf(self.source)
            alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)
            return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
        except (RuntimeError, ValueError, TypeError) as e:
            raise StructuredOutputError(f"invalid {self.kind}: {clean_message(e)}") from None


# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (minLength/maxLength)
# as [^"\\\r\n], which lets raw control characters (e.g. \x08) into a string: invalid JSON.
# The rule is rewritten to exclude U+0000-U+001F as JSON requires (tests/structured checks).
_LENGTH_BOUNDED_CHAR = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\]'


def _no_raw_control_chars(xgr, grammar):
    ebnf = str(grammar)
    if _LENGTH_BOUNDED_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR))


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise StructuredOutputError(f"{name} must be a string")
    return value


@functools.lru_cache(maxsize=1024)
def check_spec(spec: StructuredOutputSpec) -> None:
    """Raises StructuredOutputError if spec's grammar cannot be built (cached when it can:
    the ingress and every engine check each request, and schemas repeat)."""
    spec.build_grammar()
