"""KVChunk: the unit of KV cache that crosses a process boundary (framing: chunk_header.py).

The payload for ``n`` tokens is K/V ``[L, P, n, Hkv, D]`` in the dtype's storage type
followed, for a dtype with scales (FP8), by the scales ``[L, P, n, Hkv]``, raw and
contiguous. P = 2 (K and V), or 1 for an MLA layout (``...:mla``: one plane holding the
latent + RoPE key, Hkv = 1). Readers call :meth:`KVChunk.decode` with what they expect
(fingerprint, layout, key, token ids, digest) before the chunk touches a cache.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from app.kv.chunk_header import (
    MAGIC,
    PREFIX,
    TAG_SLOT,
    ChunkError,
    ChunkIntegrityError,
    ChunkMeta,
    ChunkMismatchError,
    compute_tag,
    header_values,
    hex_key,
    numel,
    pack_framing,
    parse,
    tag_hasher,
)
from app.kv.dtypes import kv_dtype
from app.kv.tagging import ThreadedTag
from slimserve_kernels import cpu_tag
from slimserve_kernels.cpu_tag import CopyingTag

__all__ = ["ChunkError", "ChunkIntegrityError", "ChunkMeta", "ChunkMismatchError", "KVChunk"]


@dataclass(frozen=True, slots=True)
class KVChunk:
    meta: ChunkMeta
    payload: memoryview = field(repr=False)
    tag: int
    # The encoded chunk (framing + payload) when payload is a view of it: encode() is free.
    wire: bytearray | memoryview | None = field(default=None, repr=False, compare=False)
    # False: decoded with verify_tag=False; the reader must check the tag (check_tag) before
    # the KV is used (the engine's import does it in the same pass as the cache write).
    verified: bool = True

    @property
    def key(self) -> bytes | None:
        return self.meta.key

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.meta.token_ids

    @property
    def nbytes(self) -> int:
        return len(self.payload)

    @classmethod
    def from_tensors(
        cls, meta: ChunkMeta, kv: torch.Tensor, scales: torch.Tensor | None = None
    ) -> KVChunk:
        """kv: [L, P, n, Hkv, D] in the dtype's storage; scales: [L, P, n, Hkv] (FP8 only).
        The tag is computed in the same pass as the copy, on this thread (from a CPU kv: in
        the copy itself, each byte read once, where the C++ tag is built)."""
        hasher = tag_hasher(meta, meta.payload_len(), copying=kv.is_cpu)
        wire, payload = _wire(meta, kv, scales, hasher)
        return cls._sealed(meta, wire, payload, hasher.intdigest())

    @classmethod
    def from_tensors_overlapped(
        cls, parts: Iterable[tuple[ChunkMeta, torch.Tensor, torch.Tensor | None]], tagger: Executor
    ) -> list[KVChunk]:
        """Chunks of (meta, kv, scales) parts whose tags ``tagger`` (a one-thread executor)
        hashes beside the copies, a few MB behind them (app/kv/tagging.py): the caller waits
        only for the last piece. Every tag still covers the whole header and payload, read
        from the very buffer that goes on the wire."""
        pending = []
        for meta, kv, scales in parts:
            tag = ThreadedTag(tag_hasher(meta, meta.payload_len()), tagger)
            wire, payload = _wire(meta, kv, scales, tag)
            pending.append((meta, wire, payload, tag.finish()))
        return [cls._sealed(m, wire, p, tag.result()) for m, wire, p, tag in pending]

    @classmethod
    def _sealed(cls, meta: ChunkMeta, wire: bytearray, payload: memoryview, tag: int) -> KVChunk:
        TAG_SLOT.pack_into(wire, len(wire) - len(payload) - TAG_SLOT.size, tag)
        return cls(meta, payload, tag, wire)

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv [L, P, n, Hkv, D], scales [L, P, n, Hkv] | None), CPU views of the payload.

        The views may share read-only memory with the received buffer: copy before writing.
        """
        dtype = kv_dtype(self.meta.kv_dtype)
        kv_shape, scale_shape = self.meta.shapes()
        kv_bytes = numel(kv_shape) * dtype.storage.itemsize
        kv = _view(self.payload[:kv_bytes], torch.uint8).view(dtype.storage).view(kv_shape)
        if scale_shape is None:
            return kv, None
        return kv, _view(self.payload[kv_bytes:], dtype.scale).view(scale_shape)

    def header_dict(self) -> dict:
        return {**header_values(self.meta, len(self.payload)), "tag": self.tag}

    def encode(self) -> bytes | bytearray | memoryview:
        """The wire form (no copy when this chunk was built or decoded here: its own
        buffer, which the caller must not modify)."""
        if self.wire is not None:
            return self.wire
        header = msgpack.packb(self.header_dict(), use_bin_type=True)
        return b"".join((PREFIX.pack(MAGIC, len(header)), header, self.payload))

    def tag_hasher(self, copying: bool = False):
        """xxh3 fed this chunk's header: feed it payload pieces in order, then check_tag
        (copying: one that can copy the pieces as it hashes them, where it is built)."""
        return tag_hasher(self.meta, len(self.payload), copying)

    def check_tag(self, computed: int) -> None:
        if computed != self.tag:
            raise ChunkIntegrityError(
                f"chunk {hex_key(self.meta.key)} tag mismatch: header says {self.tag:#018x}, "
                f"content hashes to {computed:#018x}"
            )

    def content_tag(self) -> int:
        """The tag of this chunk's header and payload as they are now (one pass)."""
        return compute_tag(self.meta, self.payload)

    def verify_tag(self) -> None:
        """The whole-payload tag check (one pass of its own)."""
        self.check_tag(self.content_tag())

    @classmethod
    def decode(
        cls,
        buf: bytes | bytearray | memoryview,
        *,
        expected_fingerprint: str | None = None,
        expected_layout: str | None = None,
        expected_kv_dtype: str | None = None,
        expected_key: bytes | None = None,
        expected_token_ids: tuple[int, ...] | list[int] | None = None,
        verify_tag: bool = True,
    ) -> KVChunk:
        """Parse and verify a buffer; the payload is a zero-copy view of ``buf``.

        Raises ChunkIntegrityError on damaged bytes and ChunkMismatchError when the chunk is
        intact but differs from an expectation. verify_tag=False leaves the payload's tag to
        the reader (``verified`` is False): framing, header and expectations are checked.
        """
        view = memoryview(buf).cast("B")
        meta, payload, tag = parse(view)
        chunk = cls(meta, payload, tag, view, verified=verify_tag)
        if verify_tag:
            chunk.verify_tag()
        chunk.check(
            fingerprint=expected_fingerprint,
            layout=expected_layout,
            kv_dtype=expected_kv_dtype,
            key=expected_key,
            token_ids=expected_token_ids,
        )
        return chunk

    def check(
        self,
        *,
        fingerprint: str | None = None,
        layout: str | None = None,
        kv_dtype: str | None = None,
        key: bytes | None = None,
        token_ids: tuple[int, ...] | list[int] | None = None,
        digest: bytes | None = None,
    ) -> None:
        """Raise ChunkMismatchError unless the header matches every given expectation."""
        m = self.meta
        wanted = (
            ("fingerprint", fingerprint, m.fingerprint),
            ("layout", layout, m.layout),
            ("kv dtype", kv_dtype and _dtype_name(kv_dtype), m.kv_dtype),
            ("key", key, m.key),
            ("prefix digest", digest, m.digest),
        )
        for what, want, got in wanted:
            if want is not None and want != got:
                raise ChunkMismatchError(
                    f"chunk {hex_key(m.key)}: {what} is {_show(got)}, expected {_show(want)}"
                )
        if token_ids is not None and tuple(token_ids) != m.token_ids:
            raise ChunkMismatchError(
                f"chunk {hex_key(m.key)}: token ids differ from the prompt's "
                f"({m.num_tokens} tokens in chunk, {len(token_ids)} expected)"
            )


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _wire(
    meta: ChunkMeta, kv: torch.Tensor, scales: torch.Tensor | None, hasher
) -> tuple[bytearray, memoryview]:
    """(the encoded chunk with its tag slot unfilled, its payload view); hasher (or None) is
    fed the payload as it is copied."""
    dtype = kv_dtype(meta.kv_dtype)
    kv_shape, scale_shape = meta.shapes()
    if tuple(kv.shape) != kv_shape or kv.dtype != dtype.storage:
        raise ValueError(
            f"kv is {tuple(kv.shape)} {kv.dtype}; chunk expects {kv_shape} {dtype.storage}"
        )
    if scale_shape is None and scales is not None:
        raise ValueError(f"{meta.kv_dtype} chunks carry no scales")
    if scale_shape is not None and (
        scales is None or tuple(scales.shape) != scale_shape or scales.dtype != dtype.scale
    ):
        got = None if scales is None else (tuple(scales.shape), scales.dtype)
        raise ValueError(f"{dtype.name} chunk needs {dtype.scale} scales {scale_shape}: {got}")
    framing = pack_framing(meta, meta.payload_len())
    # the one copy out of the cache; not zero-filled first (bytearray(n) would write every
    # byte once more before the copy does)
    wire = memoryview(np.empty(len(framing) + meta.payload_len(), dtype=np.uint8))
    wire[: len(framing)] = framing
    payload = memoryview(wire)[len(framing) :]
    _fill(payload, kv, scales, hasher)
    return wire, payload


def _fill(payload: memoryview, kv: torch.Tensor, scales, hasher) -> None:
    """Copies kv [L, P, n, Hkv, D] then scales [L, P, n, Hkv] into payload one layer at a
    time, hashing each layer's bytes (hasher not None) right after its copy, while they are
    still in cache; or each of the two in one C++ call (`_in_kernel`) that, given a
    CopyingTag, hashes in the copy (each byte read once)."""
    off = 0
    for t in (kv,) if scales is None else (kv, scales):
        size = t.numel() * t.element_size()
        bits = _INT_OF_WIDTH[t.element_size()]  # a plain copy (FP8 copy_ is slower)
        dst = _view(payload[off : off + size], torch.uint8)
        if _in_kernel(t, hasher):
            cpu_tag.copy_planes(dst, t.view(bits), hasher)
        else:
            per_layer = size // t.shape[0]
            for i, layer in enumerate(t.unbind(0)):
                piece = dst[i * per_layer : (i + 1) * per_layer]
                piece.view(bits).view(layer.shape).copy_(layer.view(bits))
                if hasher is not None:
                    hasher.update(payload[off + i * per_layer : off + (i + 1) * per_layer])
        off += size


def _in_kernel(t: torch.Tensor, hasher) -> bool:
    """Whether t's copy (and its tag, if any) goes through the C++ copy_planes: a CPU tensor
    whose planes t[l, p] are contiguous, with no hasher (the copy alone, where the kernels
    build) or a CopyingTag."""
    if not t.is_cpu or not t[0, 0].is_contiguous():
        return False
    return isinstance(hasher, CopyingTag) or (hasher is None and cpu_tag.available())


def _dtype_name(name: str) -> str:
    return kv_dtype(name).name


def _view(mv: memoryview, dtype: torch.dtype) -> torch.Tensor:
    if len(mv) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers are fine: callers copy
        return torch.frombuffer(mv, dtype=dtype)


def _show(value) -> str:
    return hex_key(value) if isinstance(value, bytes) else repr(value)
