"""Incremental detokenization that never emits a broken UTF-8 character.

Decoding only the new token ids can split a multi-byte character or drop a leading space,
so each step decodes the previous step's tokens plus the new ones and emits the text
past the window's previous decoding; text ending in U+FFFD waits for the next token. Stop
strings are searched in the full output and the last (longest stop - 1) characters are
held back so a stop string is never partly streamed.
"""

from __future__ import annotations

from app.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.stop = stop
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded output so far
        self.emitted = 0  # characters of self.text already streamed
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def primed(self, prior_ids: list[int]) -> IncrementalDetokenizer:
        """Continue after output tokens another engine already streamed (a decode replica
        after the prefill's first token): the same steps that engine took, so exactly the
        text it emitted counts as emitted, the rest (held back for stop strings, or an
        unfinished character) comes out here, and stop strings may span the two."""
        if prior_ids:
            self.add(prior_ids)
            self.take(final=False)
        return self

    def add(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        prefix = self.tok.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
        full = self.tok.decode(self.ids[self.prefix_offset :], self.skip)
        if full.endswith("\ufffd") or len(full) < len(prefix):
            return  # incomplete character: wait for more bytes
        self.text += full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def find_stop(self) -> int | None:
        """Index in self.text where the earliest stop string begins, or None."""
        start = max(0, self.emitted - self.holdback)
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def truncate(self, end: int) -> None:
        self.text = self.text[:end]

    def take(self, final: bool) -> str:
        """Text ready to stream: all of it when final, else all but the held-back tail."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
