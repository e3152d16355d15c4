"""A chunk tag hashed on another thread, fed piece by piece as the bytes are copied.

The copying thread hands each piece (a view of bytes it has just copied, so they are still
in cache) to ``tagger``, a one-thread executor; xxh3 releases the GIL, so the hashing runs
beside the next copy and the copier waits only for the last piece. Pieces are coalesced to
~``piece_bytes`` so a hand-off is paid per few MB, not per layer. A one-thread executor runs
the pieces in the order they were handed over, which the streaming hash needs.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import xxhash

PIECE_BYTES = 4 << 20


class ThreadedTag:
    """Quacks like the xxh3 hasher it wraps (``update``), then ``finish`` -> Future[int]."""

    def __init__(self, hasher: xxhash.xxh3_64, tagger: Executor, piece_bytes: int = PIECE_BYTES):
        self._hasher, self._tagger, self._piece_bytes = hasher, tagger, piece_bytes
        self._pieces: list[memoryview] = []
        self._size = 0

    def update(self, piece: memoryview) -> None:
        self._pieces.append(piece)
        self._size += len(piece)
        if self._size >= self._piece_bytes:
            self._hand_over()

    def finish(self) -> Future:
        """The tag of everything fed so far, once the tagger has hashed it."""
        self._hand_over()
        return self._tagger.submit(self._hasher.intdigest)

    def _hand_over(self) -> None:
        if self._pieces:
            self._tagger.submit(_feed, self._hasher, self._pieces)
            self._pieces, self._size = [], 0


def _feed(hasher: xxhash.xxh3_64, pieces: list[memoryview]) -> None:
    for piece in pieces:
        hasher.update(piece)
