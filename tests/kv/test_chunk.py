import msgpack
import pytest
import torch

from app.kv.chunk import ChunkIntegrityError, ChunkMeta, ChunkMismatchError, KVChunk
from app.kv.layout import KVCacheSpec, KVLayout, LayoutError

LAYOUT = str(KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4))
FP = "tiny-llama@abc123"


def _meta(kv_dtype: str, n: int = 8, key: bytes = b"k" * 16) -> ChunkMeta:
    return ChunkMeta(
        fingerprint=FP,
        kv_dtype=kv_dtype,
        layout=LAYOUT,
        token_ids=tuple(range(100, 100 + n)),
        start_pos=16,
        key=key,
        parent_key=b"p" * 16,
        digest=b"d" * 32,
    )


def _tensors(kv_dtype: str, n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, n, 2, 8, generator=g) * 3
    if kv_dtype == "fp8_e4m3":
        scales = torch.randint(-8, 4, (3, 2, n, 2), dtype=torch.int8, generator=g)
        return x.to(torch.float8_e4m3fn), scales
    return x.to({"bfloat16": torch.bfloat16, "float32": torch.float32}[kv_dtype]), None


def _encoded(kv_dtype: str = "fp8_e4m3") -> bytes:
    kv, scales = _tensors(kv_dtype)
    return bytes(KVChunk.from_tensors(_meta(kv_dtype), kv, scales).encode())


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32", "fp8_e4m3"])
def test_round_trip_is_bit_exact(kv_dtype):
    kv, scales = _tensors(kv_dtype)
    buf = KVChunk.from_tensors(_meta(kv_dtype), kv, scales).encode()
    chunk = KVChunk.decode(
        buf,
        expected_fingerprint=FP,
        expected_layout=LAYOUT,
        expected_key=b"k" * 16,
        expected_token_ids=list(range(100, 108)),
    )
    kv2, scales2 = chunk.to_tensors()
    assert kv2.dtype == kv.dtype and kv2.shape == kv.shape
    assert torch.equal(kv2.view(torch.uint8), kv.view(torch.uint8))
    if scales is None:
        assert scales2 is None
    else:
        assert torch.equal(scales2, scales)
    assert chunk.meta == _meta(kv_dtype)
    assert chunk.meta.parent_key == b"p" * 16 and chunk.meta.start_pos == 16


def test_payload_is_contiguous_kv_then_scales():
    kv, scales = _tensors("fp8_e4m3")
    chunk = KVChunk.from_tensors(_meta("fp8_e4m3"), kv, scales)
    raw = bytes(chunk.payload)
    kv_bytes = kv.numel()
    assert len(raw) == kv_bytes + scales.numel()
    assert raw[:kv_bytes] == kv.view(torch.uint8).numpy().tobytes()
    assert raw[kv_bytes:] == scales.numpy().tobytes()


def test_empty_chunk_round_trips():
    meta = _meta("bfloat16", n=0)
    kv = torch.empty(3, 2, 0, 2, 8, dtype=torch.bfloat16)
    chunk = KVChunk.decode(KVChunk.from_tensors(meta, kv).encode())
    assert chunk.to_tensors()[0].shape == (3, 2, 0, 2, 8)


def test_flipped_payload_byte_is_detected():
    buf = bytearray(_encoded())
    buf[-37] ^= 0x01
    with pytest.raises(ChunkIntegrityError, match="tag mismatch"):
        KVChunk.decode(buf)


def _rewrite_header(buf: bytes, **changes) -> bytes:
    header_len = int.from_bytes(buf[4:8], "little")
    header = msgpack.unpackb(buf[8 : 8 + header_len], raw=False)
    header.update(changes)
    new = msgpack.packb(header, use_bin_type=True)
    return buf[:4] + len(new).to_bytes(4, "little") + new + buf[8 + header_len :]


@pytest.mark.parametrize(
    "change",
    [
        {"token_ids": [100, 101, 102, 103, 104, 105, 106, 999]},
        {"start_pos": 17},
        {"key": b"x" * 16},
        {"parent_key": None},
        {"fingerprint": "other-model"},
        {"digest": b"e" * 32},
    ],
)
def test_modified_header_field_is_detected(change):
    buf = _rewrite_header(_encoded(), **change)
    with pytest.raises(ChunkIntegrityError, match="tag mismatch"):
        KVChunk.decode(buf)


def test_header_rewritten_with_same_values_still_verifies():
    # The tag covers the header's values, not one particular msgpack encoding of them.
    buf = _rewrite_header(_encoded())
    assert KVChunk.decode(buf).meta == _meta("fp8_e4m3")


def test_wrong_layout_is_rejected():
    other = str(KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16))
    with pytest.raises(ChunkMismatchError, match="layout"):
        KVChunk.decode(_encoded(), expected_layout=other)


def test_wrong_fingerprint_is_rejected():
    with pytest.raises(ChunkMismatchError, match="fingerprint"):
        KVChunk.decode(_encoded(), expected_fingerprint="tiny-llama@def456")


def test_wrong_key_and_token_ids_are_rejected():
    with pytest.raises(ChunkMismatchError, match="key"):
        KVChunk.decode(_encoded(), expected_key=b"z" * 16)
    with pytest.raises(ChunkMismatchError, match="token ids"):
        KVChunk.decode(_encoded(), expected_token_ids=list(range(101, 109)))


def test_wrong_kv_dtype_is_rejected():
    with pytest.raises(ChunkMismatchError, match="kv dtype"):
        KVChunk.decode(_encoded("fp8_e4m3"), expected_kv_dtype="bf16")


@pytest.mark.parametrize("cut", [0, 3, 7, 8, 40, -1, -100])
def test_truncated_buffer_is_rejected_cleanly(cut):
    buf = _encoded()
    with pytest.raises(ChunkIntegrityError, match="truncated|payload is"):
        KVChunk.decode(buf[:cut])


def test_garbage_is_rejected_cleanly():
    with pytest.raises(ChunkIntegrityError, match="not a KV chunk"):
        KVChunk.decode(b"\x80\x04" + b"\x00" * 64)  # a pickle prefix is not a chunk
    bad = b"SKVC" + (5).to_bytes(4, "little") + b"\xc1\xc1\xc1\xc1\xc1"
    with pytest.raises(ChunkIntegrityError, match="malformed chunk header"):
        KVChunk.decode(bad)


def test_header_with_wrong_types_is_rejected():
    buf = _rewrite_header(_encoded(), token_ids="not a list")
    with pytest.raises(ChunkIntegrityError, match="token_ids"):
        KVChunk.decode(buf)


def test_payload_length_must_match_shape():
    buf = _encoded()
    header_len = int.from_bytes(buf[4:8], "little")
    # A consistent header and tag can still describe a payload the layout cannot hold.
    bigger = _rewrite_header(buf + b"\x00", payload_len=len(buf) - 8 - header_len + 1)
    with pytest.raises(ChunkIntegrityError, match="shape needs"):
        KVChunk.decode(bigger)


def test_from_tensors_validates_shapes():
    kv, scales = _tensors("fp8_e4m3")
    with pytest.raises(ValueError, match="expects"):
        KVChunk.from_tensors(_meta("fp8_e4m3", n=7), kv, scales)
    with pytest.raises(ValueError, match="int8 scales"):
        KVChunk.from_tensors(_meta("fp8_e4m3"), kv, None)
    with pytest.raises(ValueError, match="no scales"):
        bf, _ = _tensors("bfloat16")
        KVChunk.from_tensors(_meta("bfloat16"), bf, scales)


def test_layout_parse_round_trips():
    lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, tp_rank=1, tp_size=2)
    assert KVLayout.parse(str(lay)) == lay
    single = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)
    assert str(single) == "paged-v1:L2:H2:D16:B16:tp1"  # the engine's KVCacheSpec.layout
    assert KVLayout.parse(str(single)) == single
    for bad in ("v0:L1:H1:D1:B1:tp0/1", "paged-v1:L1:H1:D1:tp1", "paged-v1:X1:H1:D1:B1:tp1"):
        with pytest.raises(LayoutError):
            KVLayout.parse(bad)


def test_engine_layout_string_parses():
    spec = KVCacheSpec(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float8_e4m3fn
    )
    assert str(KVLayout.parse(spec.layout)) == spec.layout
