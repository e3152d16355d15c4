"""One sequence's place in its grammar: accept tokens, fill its row of the token bitmask.

The compiled grammar is shared (one per spec); each sequence (each of n samples) has its
own matcher. Until the compile future is done the sequence is not ready and the scheduler
leaves it waiting. `replay` holds output tokens sampled elsewhere (the prefill replica's
first token) that the matcher accepts before this engine samples anything.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from app.engine.structured.backend import StructuredOutputError, xgrammar
from app.engine.structured.spec import StructuredOutputSpec


class SequenceGrammar:
    def __init__(self, spec: StructuredOutputSpec, compiled: Future, replay: tuple[int, ...] = ()):
        self.spec = spec
        self._compiled = compiled
        self._replay = tuple(replay)
        self._matcher = None
        self._usable = False
        self.num_accepted = 0  # tokens accepted since the grammar's start (replay included)

    @property
    def compiled(self) -> bool:
        """The compile finished, successfully or not (then `settle` says which)."""
        return self._compiled.done()

    @property
    def ready(self) -> bool:
        """Compiled and checked usable by `settle`: the sequence may be scheduled. (A
        compile that ends between the engine's check and the scheduler's must not let a
        failed grammar through, so readiness is only ever set by settle.)"""
        return self._usable

    def settle(self) -> str | None:
        """Once compiled: why the grammar cannot be used, or None (it is then ready)."""
        why = self.failed
        self._usable = why is None
        return why

    @property
    def failed(self) -> str | None:
        """Why this grammar cannot be used (compile failed, replay rejected), else None."""
        if not self._compiled.done():
            return None
        if self._compiled.cancelled():
            return "grammar compilation was cancelled"
        error = self._compiled.exception()
        if error is not None:
            return str(error)
        try:
            self.matcher()
        except StructuredOutputError as e:
            return str(e)
        return None

    def matcher(self):
        if self._matcher is None:
            self._matcher = xgrammar().GrammarMatcher(self._compiled.result())
            for token in self._replay:
                if not self.accept(token):
                    raise StructuredOutputError(
                        f"token {token} sampled before this replica does not fit the grammar"
                    )
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (state unchanged)."""
        ok = self.matcher().accept_token(token)
        self.num_accepted += ok
        return ok

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculative decoding rejections)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} tokens")
        if num_tokens:
            self.matcher().rollback(num_tokens)
            self.num_accepted -= num_tokens

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted its stop token: the sequence ends ("stop")."""
        return self._matcher is not None and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask: [B, ceil(V / 32)] int32 on the CPU; bit v of row = token v allowed."""
        self.matcher().fill_next_token_bitmask(bitmask, row)
