"""Structured outputs: JSON schema, choice, regex and EBNF grammars enforced on the logits.

Importable without xgrammar; the grammar engine loads when a request first needs it.
spec (what to generate) -> compiler (off the step loop, cached) -> matcher (per sequence)
-> logits (the batch's bitmask); manager ties them to the engine; tools builds tool-call
specs and parses their output.
"""

from app.engine.structured.backend import StructuredOutputError
from app.engine.structured.spec import StructuredOutputSpec, check_spec

__all__ = ["StructuredOutputError", "StructuredOutputSpec", "check_spec"]
