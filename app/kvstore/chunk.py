"""KVChunk: the unit of KV cache that crosses a process boundary.

Wire format (one buffer, no pickle)::

    b"SKVC" | u32 LE header length H | H bytes msgpack header | payload

The header is a msgpack map (format version, model fingerprint, kv dtype, layout, token ids,
start position, parent key, key, payload length, tag). The payload for ``n`` tokens is
K/V ``[L, P, n, Hkv, D]`` in the cache dtype followed, for FP8 only, by the scale exponents
``[L, P, n, Hkv]`` int8, raw and contiguous. P = 2 (K and V), or 1 for an MLA layout
(``...:mla``: one plane holding the latent + RoPE key, Hkv = 1).

``tag = xxh3_64(canonical header without tag || payload)``: the header is re-encoded
canonically (fixed key order) on read, so any changed field, or any flipped payload byte,
changes the tag. Readers call :meth:`KVChunk.decode` with what they expect (fingerprint,
layout, key, token ids) before the chunk touches a cache.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field

import msgpack
import torch
import xxhash

FORMAT_VERSION = 1
LAYOUT_VERSION = "paged-v1"  # = app.engine.block_hash.LAYOUT_VERSION
_MAGIC = b"SKVC"
_PREFIX = struct.Struct("<4sI")
_MAX_HEADER_BYTES = 16 << 20  # bounds what a corrupt length field can make us read

KV_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
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
    "payload_len",
)


class ChunkError(ValueError):
    """A chunk that must not be used."""


class ChunkIntegrityError(ChunkError):
    """The bytes are damaged: bad framing, truncated, malformed header or tag mismatch."""


class ChunkMismatchError(ChunkError):
    """The chunk is intact but not the one the reader asked for (model, layout, key, tokens)."""


def kv_dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical chunk dtype name for a torch dtype or a config name ("bf16", "fp8_e4m3")."""
    if isinstance(dtype, torch.dtype):
        for name, d in KV_DTYPES.items():
            if d == dtype:
                return name
        raise ValueError(f"unsupported KV dtype {dtype}")
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name not in KV_DTYPES:
        raise ValueError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(KV_DTYPES)}")
    return name


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape facts a reader must share with the writer to use a chunk's payload."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    use_mla: bool = False  # one plane (MLA latent + rope key) instead of K and V

    @property
    def num_planes(self) -> int:
        return 1 if self.use_mla else 2

    def __str__(self) -> str:
        # The engine's KVCacheSpec.layout spelling; tp rank only when sharded.
        tp = f"tp{self.tp_size}" if self.tp_size == 1 else f"tp{self.tp_rank}/{self.tp_size}"
        return (
            f"{LAYOUT_VERSION}:L{self.num_layers}:H{self.num_kv_heads}:D{self.head_dim}"
            f":B{self.block_size}:{tp}" + (":mla" if self.use_mla else "")
        )

    @classmethod
    def parse(cls, text: str) -> KVLayout:
        """Inverse of ``str``; also reads ``tp{rank}/{size}`` and ``tp{size}``."""
        try:
            parts = text.split(":")
            use_mla = len(parts) == 7 and parts[-1] == "mla"
            version, layers, heads, dim, block, tp = parts[:-1] if use_mla else parts
            if version != LAYOUT_VERSION:
                raise ValueError(f"layout version {version!r}, this build reads {LAYOUT_VERSION!r}")
            rank, _, size = tp.removeprefix("tp").rpartition("/")
            fields = {"L": layers, "H": heads, "D": dim, "B": block}
            for prefix, value in fields.items():
                if not value.startswith(prefix):
                    raise ValueError(f"expected {prefix}<n>, got {value!r}")
            return cls(
                int(layers[1:]),
                int(heads[1:]),
                int(dim[1:]),
                int(block[1:]),
                int(rank or 0),
                int(size),
                use_mla,
            )
        except ValueError as e:
            raise ChunkMismatchError(f"unreadable KV layout {text!r}: {e}") from None


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """Everything in a chunk's header except the sizes and the tag, which are derived."""

    fingerprint: str
    kv_dtype: str
    layout: str
    token_ids: tuple[int, ...]
    start_pos: int
    key: bytes | None
    parent_key: bytes | None = None

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "kv_dtype", kv_dtype_name(self.kv_dtype))
        assert self.start_pos >= 0, "start_pos must be >= 0"

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == "fp8_e4m3"

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """(kv shape, scales shape or None) of this chunk's payload."""
        lay = KVLayout.parse(self.layout)
        n = self.num_tokens
        p = lay.num_planes
        kv = (lay.num_layers, p, n, lay.num_kv_heads, lay.head_dim)
        scales = (lay.num_layers, p, n, lay.num_kv_heads) if self.is_fp8 else None
        return kv, scales

    def payload_len(self) -> int:
        kv, scales = self.shapes()
        size = _numel(kv) * KV_DTYPES[self.kv_dtype].itemsize
        return size + (_numel(scales) if scales else 0)


@dataclass(frozen=True, slots=True)
class KVChunk:
    meta: ChunkMeta
    payload: memoryview = field(repr=False)
    tag: int

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
        """kv: [L, P, n, Hkv, D] in meta.kv_dtype; scales: [L, P, n, Hkv] int8 (FP8 only)."""
        kv_shape, scale_shape = meta.shapes()
        if tuple(kv.shape) != kv_shape or kv.dtype != KV_DTYPES[meta.kv_dtype]:
            raise ValueError(
                f"kv is {tuple(kv.shape)} {kv.dtype}; chunk expects {kv_shape} "
                f"{KV_DTYPES[meta.kv_dtype]}"
            )
        if scale_shape is None and scales is not None:
            raise ValueError(f"{meta.kv_dtype} chunks carry no scales")
        if scale_shape is not None and (
            scales is None or tuple(scales.shape) != scale_shape or scales.dtype != torch.int8
        ):
            got = None if scales is None else (tuple(scales.shape), scales.dtype)
            raise ValueError(f"FP8 chunk needs int8 scales {scale_shape}, got {got}")
        buf = bytearray(meta.payload_len())  # one copy from the cache into the payload
        flat = _view(memoryview(buf), torch.uint8)
        kv_bytes = kv.numel() * kv.element_size()
        flat[:kv_bytes].copy_(_as_bytes(kv))
        if scales is not None:
            flat[kv_bytes:].copy_(_as_bytes(scales))
        payload = memoryview(buf)
        return cls(meta, payload, _compute_tag(_canonical_header(meta, len(payload)), payload))

    def to_tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv [L, P, n, Hkv, D], scales [L, P, n, Hkv] | None), CPU views of the payload.

        The views may share read-only memory with the received buffer: copy before writing.
        """
        kv_shape, scale_shape = self.meta.shapes()
        dtype = KV_DTYPES[self.meta.kv_dtype]
        kv_bytes = _numel(kv_shape) * dtype.itemsize
        kv = _view(self.payload[:kv_bytes], torch.uint8).view(dtype).view(kv_shape)
        if scale_shape is None:
            return kv, None
        return kv, _view(self.payload[kv_bytes:], torch.int8).view(scale_shape)

    def header_dict(self) -> dict:
        return {**_header_values(self.meta, len(self.payload)), "tag": self.tag}

    def encode(self) -> bytes:
        header = msgpack.packb(self.header_dict(), use_bin_type=True)
        return b"".join((_PREFIX.pack(_MAGIC, len(header)), header, self.payload))

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
    ) -> KVChunk:
        """Parse and verify a buffer; the payload is a zero-copy view of ``buf``.

        Raises ChunkIntegrityError on damaged bytes and ChunkMismatchError when the chunk is
        intact but differs from an expectation.
        """
        view = memoryview(buf).cast("B")
        meta, payload, tag = _parse(view)
        expected_tag = _compute_tag(_canonical_header(meta, len(payload)), payload)
        if tag != expected_tag:
            raise ChunkIntegrityError(
                f"chunk {_hex(meta.key)} tag mismatch: header says {tag:#018x}, "
                f"content hashes to {expected_tag:#018x}"
            )
        chunk = cls(meta, payload, tag)
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
    ) -> None:
        """Raise ChunkMismatchError unless the header matches every given expectation."""
        m = self.meta
        wanted = (
            ("fingerprint", fingerprint, m.fingerprint),
            ("layout", layout, m.layout),
            ("kv dtype", kv_dtype and kv_dtype_name(kv_dtype), m.kv_dtype),
            ("key", key, m.key),
        )
        for what, want, got in wanted:
            if want is not None and want != got:
                raise ChunkMismatchError(
                    f"chunk {_hex(m.key)}: {what} is {_show(got)}, expected {_show(want)}"
                )
        if token_ids is not None and tuple(token_ids) != m.token_ids:
            raise ChunkMismatchError(
                f"chunk {_hex(m.key)}: token ids differ from the prompt's "
                f"({m.num_tokens} tokens in chunk, {len(token_ids)} expected)"
            )


def _parse(view: memoryview) -> tuple[ChunkMeta, memoryview, int]:
    if len(view) < _PREFIX.size:
        raise ChunkIntegrityError(f"chunk truncated: {len(view)} bytes, no header")
    magic, header_len = _PREFIX.unpack_from(view)
    if magic != _MAGIC:
        raise ChunkIntegrityError(f"not a KV chunk (magic {bytes(magic)!r})")
    end = _PREFIX.size + header_len
    if header_len > _MAX_HEADER_BYTES or end > len(view):
        raise ChunkIntegrityError(f"chunk truncated: header needs {end} bytes, have {len(view)}")
    try:
        h = msgpack.unpackb(view[_PREFIX.size : end], raw=False, strict_map_key=True)
        version = h.get("version") if isinstance(h, dict) else None
        if version != FORMAT_VERSION:
            raise ValueError(f"unsupported chunk format version {version!r}")
        meta = ChunkMeta(
            fingerprint=_typed(h, "fingerprint", str),
            kv_dtype=_typed(h, "kv_dtype", str),
            layout=_typed(h, "layout", str),
            token_ids=tuple(_ints(h["token_ids"])),
            start_pos=_typed(h, "start_pos", int),
            key=_typed(h, "key", (bytes, type(None))),
            parent_key=_typed(h, "parent_key", (bytes, type(None))),
        )
        payload_len = _typed(h, "payload_len", int)
        tag = _typed(h, "tag", int)
    except (ValueError, KeyError, TypeError, AssertionError, msgpack.ExtraData) as e:
        raise ChunkIntegrityError(f"malformed chunk header: {e}") from None
    if len(view) - end != payload_len:
        raise ChunkIntegrityError(
            f"chunk {_hex(meta.key)} payload is {len(view) - end} bytes, header says {payload_len}"
        )
    try:
        shaped_len = meta.payload_len()
    except ChunkMismatchError as e:
        raise ChunkIntegrityError(str(e)) from None
    if shaped_len != payload_len:
        raise ChunkIntegrityError(
            f"chunk {_hex(meta.key)} payload is {payload_len} bytes, its shape needs {shaped_len}"
        )
    return meta, view[end:], tag


def _header_values(m: ChunkMeta, payload_len: int) -> dict:
    values = (FORMAT_VERSION, m.fingerprint, m.kv_dtype, m.layout, list(m.token_ids))
    values += (m.start_pos, m.parent_key, m.key, payload_len)
    return dict(zip(_FIELDS, values))


def _canonical_header(meta: ChunkMeta, payload_len: int) -> bytes:
    return msgpack.packb(list(_header_values(meta, payload_len).values()), use_bin_type=True)


def _compute_tag(header: bytes, payload: memoryview) -> int:
    h = xxhash.xxh3_64(header)
    h.update(payload)
    return h.intdigest()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1).cpu()


def _view(mv: memoryview, dtype: torch.dtype) -> torch.Tensor:
    if len(mv) == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers are fine: callers copy
        return torch.frombuffer(mv, dtype=dtype)


def _numel(shape: tuple[int, ...]) -> int:
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


def _hex(key: bytes | None) -> str:
    return key.hex()[:16] if key else "<no key>"


def _show(value) -> str:
    return _hex(value) if isinstance(value, bytes) else repr(value)
