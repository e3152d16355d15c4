"""A chunk's header: `ChunkMeta`, its msgpack framing, the integrity tag, and errors.

Wire format (one buffer, no pickle)::

    b"SKVC" | u32 LE header length H | H bytes msgpack header | payload

``tag = xxh3_64(canonical header without tag || payload)``: the header is re-encoded
canonically (fixed field order) on read, so any changed field, or any flipped payload byte,
changes the tag.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack
import xxhash

from app.kv.dtypes import kv_dtype
from app.kv.layout import KVLayout, LayoutError
from slimserve_kernels import cpu_tag

FORMAT_VERSION = 2  # 2: the header carries the prefix digest (app/kv/keys.py)
MAGIC = b"SKVC"
PREFIX = struct.Struct("<4sI")
_MAX_HEADER_BYTES = 16 << 20  # bounds what a corrupt length field can make us read
# Header fields in canonical order; the tag covers exactly these, encoded in this order.
_FIELDS = (
    "version",
    "fingerprint",
    "kv_dtype",
    "layout",
    "token_ids",
    "start_pos",
    "parent_key",
    "key",
    "digest",
    "payload_len",
)


class ChunkError(ValueError):
    """A chunk that must not be used."""


class ChunkIntegrityError(ChunkError):
    """The bytes are damaged: bad framing, truncated, malformed header or tag mismatch."""


class ChunkMismatchError(ChunkError):
    """The chunk is intact but not the one the reader asked for (model, layout, key, tokens)."""


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """Everything in a chunk's header except the sizes and the tag, which are derived.

    key: the xxh3 chain key (store lookup); digest: the BLAKE2b prefix digest of salt + every
    token id up to the chunk's end (app/kv/keys.py), which an importer recomputes."""

    fingerprint: str
    kv_dtype: str
    layout: str
    token_ids: tuple[int, ...]
    start_pos: int
    key: bytes | None
    parent_key: bytes | None = None
    digest: bytes | None = None

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "kv_dtype", kv_dtype(self.kv_dtype).name)
        assert self.start_pos >= 0, "start_pos must be >= 0"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(kv shape, scales shape or None) of this chunk's payload."""
        try:
            lay = KVLayout.parse(self.layout)
        except LayoutError as e:
            raise ChunkMismatchError(str(e)) from None
        kv = (lay.num_layers, lay.num_planes, self.num_tokens, lay.num_kv_heads, lay.head_dim)
        return kv, kv[:-1] if kv_dtype(self.kv_dtype).has_scales else None

    def payload_len(self) -> int:
        dtype = kv_dtype(self.kv_dtype)
        kv, scales = self.shapes()
        size = numel(kv) * dtype.storage.itemsize
        return size + (numel(scales) * dtype.scale.itemsize if scales else 0)


def parse(view: memoryview) -> tuple[ChunkMeta, memoryview, int]:
    """Framing and header of a buffer -> (meta, payload view, tag); the tag is not checked."""
    if len(view) < PREFIX.size:
        raise ChunkIntegrityError(f"chunk truncated: {len(view)} bytes, no header")
    magic, header_len = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ChunkIntegrityError(f"not a KV chunk (magic {bytes(magic)!r})")
    end = PREFIX.size + header_len
    if header_len > _MAX_HEADER_BYTES or end > len(view):
        raise ChunkIntegrityError(f"chunk truncated: header needs {end} bytes, have {len(view)}")
    meta, payload_len, tag = _read_header(view[PREFIX.size : end])
    if len(view) - end != payload_len:
        raise ChunkIntegrityError(
            f"chunk {hex_key(meta.key)} payload is {len(view) - end} bytes, "
            f"header says {payload_len}"
        )
    try:
        shaped_len = meta.payload_len()
    except ChunkMismatchError as e:
        raise ChunkIntegrityError(str(e)) from None
    if shaped_len != payload_len:
        raise ChunkIntegrityError(
            f"chunk {hex_key(meta.key)} payload is {payload_len} bytes, "
            f"its shape needs {shaped_len}"
        )
    return meta, view[end:], tag


def _read_header(raw: memoryview) -> tuple[ChunkMeta, int, int]:
    optional_bytes = (bytes, type(None))
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        version = h.get("version") if isinstance(h, dict) else None
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported chunk format version {version!r}")
        meta = ChunkMeta(
            fingerprint=_typed(h, "fingerprint", str),
            kv_dtype=_typed(h, "kv_dtype", str),
            layout=_typed(h, "layout", str),
            token_ids=tuple(_ints(h["token_ids"])),
            start_pos=_typed(h, "start_pos", int),
            key=_typed(h, "key", optional_bytes),
            parent_key=_typed(h, "parent_key", optional_bytes),
            digest=_typed(h, "digest", optional_bytes),
        )
        return meta, _typed(h, "payload_len", int), _typed(h, "tag", int)
    except (ValueError, KeyError, TypeError, AssertionError, msgpack.ExtraData) as e:
        raise ChunkIntegrityError(f"malformed chunk header: {e}") from None


def header_values(m: ChunkMeta, payload_len: int) -> dict:
    values = (FORMAT_VERSION, m.fingerprint, m.kv_dtype, m.layout, list(m.token_ids))
    values += (m.start_pos, m.parent_key, m.key, m.digest, payload_len)
    return dict(zip(_FIELDS, values))


def tag_hasher(meta: ChunkMeta, payload_len: int, copying: bool = False):
    """xxh3_64 fed the canonical header: feed it the payload, in order, in any pieces.

    copying: for a caller that copies the payload on the CPU as it feeds it (the export's
    encode, the import's cache write): the C++ tag that copies and hashes in one pass
    (`slimserve_kernels.cpu_tag.CopyingTag`, the same digest) where it is built, else the
    `xxhash` package's."""
    prefix = msgpack.packb(list(header_values(meta, payload_len).values()), use_bin_type=True)
    if copying and cpu_tag.available():
        return cpu_tag.CopyingTag(prefix)
    return xxhash.xxh3_64(prefix)


def compute_tag(meta: ChunkMeta, payload: memoryview) -> int:
    h = tag_hasher(meta, len(payload))
    h.update(payload)
    return h.intdigest()


def pack_framing(meta: ChunkMeta, payload_len: int) -> bytes:
    """PREFIX + msgpack header of a chunk whose tag is not known yet: the tag is the last
    field, packed as a fixed-width uint64 whose 8 big-endian bytes end the returned bytes
    (TAG_SLOT.pack_into(buf, len(framing) - 8, tag) fills it in)."""
    header = msgpack.packb({**header_values(meta, payload_len), "tag": 2**64 - 1})
    assert header[-9] == 0xCF  # msgpack uint64: the slot is the last 8 bytes
    return PREFIX.pack(MAGIC, len(header)) + header


TAG_SLOT = struct.Struct(">Q")


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _typed(h: dict, name: str, types):
    value = h[name]
    if not isinstance(value, types) or isinstance(value, bool):
        raise TypeError(f"header field {name!r} has type {type(value).__name__}")
    return value


def _ints(values) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise TypeError("header field 'token_ids' must be a list of ints")
    return values


def hex_key(key: bytes | None) -> str:
    return key.hex()[:16] if key else "<no key>"
