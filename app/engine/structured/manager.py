"""The engine's structured-output state: validation, compiles in flight, mask and advance.

The engine calls four things: `attach` when a request arrives (validates its spec on the
spot, so a bad schema fails add_request; starts the compile), `poll` before scheduling
(sequences whose compile failed), `mask` on the sampled rows' logits, and `advance` with
each sampled token. The compiler (and xgrammar) is created only when a request needs it.
"""

from __future__ import annotations

import logging
import threading

import torch

from app.engine.structured.compiler import GrammarCompiler
from app.engine.structured.logits import apply_bitmask, speculative_bitmask
from app.engine.structured.matcher import SequenceGrammar
from app.engine.structured.spec import StructuredOutputSpec, check_spec
from app.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        idle: threading.Event | None = None,
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler: GrammarCompiler | None = None
        self._compiling: list = []  # sequences whose grammar was not compiled when added
        self._signal = idle or threading.Event()  # a compile finished, or the engine woken

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    def attach(self, seqs: list, spec: StructuredOutputSpec, replay: list[int]) -> None:
        """Gives each sequence its own matcher over one shared compile; a bad spec raises
        StructuredOutputError (a ValueError) here, before anything is queued."""
        check_spec(spec)
        future = self.compiler.submit(spec)
        future.add_done_callback(lambda _: self._signal.set())
        for seq in seqs:
            seq.grammar = SequenceGrammar(spec, future, tuple(replay))
            self._compiling.append(seq)  # ready once poll has settled it

    def poll(self) -> list[tuple[object, str]]:
        """(sequence, why) for sequences whose grammar cannot be used; forgets finished
        compiles. Such sequences never ran, so they can be ended without output."""
        failed, still = [], []
        for seq in self._compiling:
            if not seq.grammar.compiled:
                still.append(seq)
            elif (why := seq.grammar.settle()) is not None:
                failed.append((seq, why))
        self._compiling = still
        return failed

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def wait(self, timeout_s: float) -> None:
        """Nothing can run but compiles are in flight: sleep until one finishes, the engine
        is woken, or timeout (cleared after, as `Transfers.wait`)."""
        if not any(seq.grammar.compiled for seq in self._compiling):
            self._signal.wait(timeout_s)
        self._signal.clear()

    def mask(self, logits: torch.Tensor, seqs: list) -> None:
        """logits: [R, V], 1 + len(seq.spec_tokens) rows per sampled sequence in order;
        masked in place where a grammar applies (speculated rows: logits.speculative_bitmask)."""
        if all(s.grammar is None for s in seqs):
            return
        bitmask, rows = speculative_bitmask(seqs, logits.shape[-1])
        apply_bitmask(logits, bitmask, rows)

    def advance(self, seq, token: int) -> bool:
        """Feeds a sampled token to the sequence's matcher; False if the grammar rejects it
        (which masking should make impossible: the sequence is then aborted, not 'stop')."""
        grammar = getattr(seq, "grammar", None)
        if grammar is None or grammar.accept(token):
            return True
        log.error("request %s: token %d rejected by its grammar", seq.request_id, token)
        return False

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()
