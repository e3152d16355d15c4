"""The vectorized CPU decode attention equals the reference, FP8 and full precision."""

import pytest
import torch

from app.engine import torch_attention
from slimserve_kernels import reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_decode_matches_reference(dtype):
    torch.manual_seed(0)
    nb, bs, hkv, hq, d = 12, 4, 2, 6, 16
    k = torch.randn(nb * bs, hkv, d) * 3
    v = torch.randn(nb * bs, hkv, d)
    kc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    fp8 = dtype == torch.float8_e4m3fn
    ks = torch.zeros(nb, bs, hkv, dtype=torch.int8) if fp8 else None
    vs = torch.zeros_like(ks) if fp8 else None
    reference.kv_write(k, v, kc, vc, ks, vs, torch.randperm(nb * bs))
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 16, 1], dtype=torch.int32)
    q = torch.randn(3, hq, d)
    args = (q, kc, vc, ks, vs, tables, lens, d**-0.5)
    torch.testing.assert_close(
        torch_attention.paged_decode_attention(*args),
        reference.paged_decode_attention(*args),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_decode_layer_matches_write_then_attend(dtype):
    """The per-step context path (prepare_decode once, decode_layer per layer) writes the
    same cache and returns the same output as the reference kv_write + decode attention; a
    slot < 0 (a padding row) writes nothing.
    Seen failing: with the -1 slot written as-is (index_copy_ of every row: IndexError)."""
    torch.manual_seed(1)
    nb, bs, hkv, hq, d = 12, 4, 2, 6, 16
    fp8 = dtype == torch.float8_e4m3fn
    caches = []
    for _ in range(2):
        kc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
        scales = [torch.zeros(nb, bs, hkv, dtype=torch.int8) if fp8 else None for _ in "kv"]
        caches.append((kc, torch.zeros_like(kc), *scales))
    old = torch.randn(nb * bs, hkv, d)
    for c in caches:
        reference.kv_write(old, old * 2, *c, torch.arange(nb * bs))
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 16, 1], dtype=torch.int32)
    slots = torch.tensor([1 * bs + 1, 11 * bs + 3, -1])  # the third row is padding
    q, k, v = torch.randn(3, hq, d), torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    reference.kv_write(k, v, *caches[0], slots)
    want = reference.paged_decode_attention(q, *caches[0], tables, lens, d**-0.5)
    ctx = torch_attention.prepare_decode(tables, lens, slots, bs)
    got = torch_attention.decode_layer(ctx, q, k, v, *caches[1], d**-0.5)
    for a, b in zip(caches[0], caches[1]):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_values_equal_the_cast_for_every_code(fp8, dtype):
    """The table lookup equals PyTorch's own cast bit for bit, for all 256 codes (NaNs
    included), in a non-contiguous gathered shape."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(3).view(fp8)
    x = codes.view(2, 3, 2, 64)[:, ::2]  # non-contiguous, like a view of a gathered cache
    got, want = torch_attention.fp8_values(x, dtype), x.to(dtype)
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
