"""The KV dtype table and the block hashes (keys find, digests prove)."""

import pytest
import torch

from app.kv.dtypes import KV_DTYPES, kv_dtype, resolve
from app.kv.keys import chain_hashes, chunk_hash, make_salt, next_hash
from app.kv.layout import KVCacheSpec

SALT = make_salt("fp", "fp8_e4m3", "paged-v1:L1:H1:D8:B4:tp1", None)


def test_table_names_aliases_and_storage():
    assert kv_dtype("bf16") is kv_dtype("bfloat16") is kv_dtype(torch.bfloat16)
    assert resolve("auto", torch.float32).name == "float32"
    assert [d.name for d in KV_DTYPES if d.has_scales] == ["fp8_e4m3"]
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        kv_dtype("int3")


def test_bytes_per_token_follow_the_table():
    # FP8: one byte per element + one int8 exponent per token-head; BF16: two bytes.
    fp8 = KVCacheSpec(32, 8, 128, 16, "fp8_e4m3")
    bf16 = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    assert fp8.bytes_per_token() == 32 * 2 * 8 * (128 + 1)
    assert bf16.bytes_per_token() == 32 * 2 * 8 * 256
    assert fp8.tensor_shapes(3) == ((32, 2, 3, 16, 8, 128), (32, 2, 3, 16, 8))
    assert bf16.tensor_shapes(3)[1] is None


def test_digest_names_the_whole_prefix_and_salt():
    x = list(range(4))
    after_a = chain_hashes([9, 9, 9, 9] + x, 4, SALT)[-1]
    after_z = chain_hashes([7, 7, 7, 7] + x, 4, SALT)[-1]
    assert after_a.digest != after_z.digest
    other_salt = make_salt("fp", "fp8_e4m3", "paged-v1:L1:H1:D8:B4:tp1", "tenant")
    assert next_hash(None, x, SALT).digest != next_hash(None, x, other_salt).digest
    # A full chunk's hash is its last block's; chaining is incremental (same as one pass).
    first = chain_hashes(x, 4, SALT)[-1]
    assert chunk_hash(first, x + x, SALT, 4, full=True) == chain_hashes(x * 3, 4, SALT)[-1]
