"""ChunkFormat: what one engine's chunks are stamped with, and what its readers require.

One concept for both ends of a transfer: the exporting engine stamps every chunk's header with
its model fingerprint, KV dtype and layout (``meta``), and every reader (the engine's import,
the KV store's fetch) refuses a chunk whose header names another (``check``), so KV made for
another model, dtype or cache layout never reaches a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.kv.chunk import ChunkMeta, ChunkMismatchError, KVChunk
from app.kv.chunk_header import hex_key
from app.kv.keys import BlockHash
from app.kv.layout import KVCacheSpec, KVLayout


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    fingerprint: str  # the model (app/engine/fingerprint.py)
    spec: KVCacheSpec  # KV dtype, layout, block size of the cache the chunks come from / go to
    chunk_tokens: int  # tokens in a full chunk (a multiple of spec.block_size)

    def __post_init__(self):
        assert self.chunk_tokens > 0 and self.chunk_tokens % self.spec.block_size == 0, (
            f"chunk_tokens {self.chunk_tokens} is not a multiple of {self.spec.block_size}"
        )

    @classmethod
    def from_layout(
        cls, fingerprint: str, kv_dtype: str, layout: str, chunk_tokens: int
    ) -> ChunkFormat:
        """The format named by a header's strings (a reader that has no cache of its own)."""
        lay = KVLayout.parse(layout)
        dims = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size)
        return cls(fingerprint, KVCacheSpec(*dims, kv_dtype, lay.use_mla), chunk_tokens)

    @property
    def layout(self) -> str:
        return self.spec.layout

    @property
    def kv_dtype(self) -> str:
        return self.spec.dtype.name

    def check(self, chunk: KVChunk) -> None:
        """Raise ChunkMismatchError unless the chunk is of this model, dtype and layout (the
        message names all three, both sides, so a log shows what was offered)."""
        m, ours = chunk.meta, (self.fingerprint, self.kv_dtype, self.layout)
        if (m.fingerprint, m.kv_dtype, m.layout) != ours:
            raise ChunkMismatchError(
                f"chunk {hex_key(m.key)} is for {m.fingerprint}/{m.kv_dtype}/{m.layout}, "
                "this cache takes {}/{}/{}".format(*ours)
            )

    def is_full(self, num_tokens: int) -> bool:
        """A full chunk (cacheable, keyed by its last block) rather than a prompt's tail."""
        return num_tokens % self.spec.block_size == 0 and num_tokens >= self.chunk_tokens

    def meta(
        self, token_ids: tuple[int, ...], start: int, h: BlockHash, parent: BlockHash | None
    ) -> ChunkMeta:
        """The header of a chunk of token_ids at start whose hash is h."""
        return ChunkMeta(
            self.fingerprint,
            self.kv_dtype,
            self.layout,
            token_ids,
            start,
            h.key,
            parent.key if parent else None,
            h.digest,
        )
