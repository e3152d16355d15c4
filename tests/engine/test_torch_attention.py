"""The vectorized CPU decode attention equals the reference, FP8 and full precision."""

import pytest
import torch

from app.engine import torch_attention
from kernels import reference


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
