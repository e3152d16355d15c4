"""Triton paged decode / prefill attention vs the references, under the interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import ATTN_TOL, FP8, block_tables, empty_cache, filled_cache, random_kv

from slimserve_kernels import reference

pytestmark = pytest.mark.triton
decode = pytest.importorskip("slimserve_kernels.paged_decode")
prefill = pytest.importorskip("slimserve_kernels.paged_prefill")
from slimserve_kernels.kv_write_triton import kv_write as kv_write_triton  # noqa: E402

CACHE_DTYPES = [FP8, torch.float16, torch.float32]


def _assert_close(out, ref, dtype):
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(cache_dtype, q_dtype, num_splits):
    gen = torch.Generator().manual_seed(0)
    lens, hq, hkv, d, bs = [5, 70, 133], 8, 2, 32, 16  # GQA 4, unequal lens
    cache = filled_cache(cache_dtype, 24, bs, hkv, d, gen)
    table = block_tables(lens, bs, 24, gen)
    q = torch.randn(3, hq, d, generator=gen).to(q_dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, *cache.args(), table, seq_lens, d**-0.5)
    out = decode.paged_decode_attention(*args, num_splits=num_splits, block_n=16)
    _assert_close(out, reference.paged_decode_attention(*args), q_dtype)


@pytest.mark.parametrize(
    "lens,hq,hkv,d,bs,num_splits",
    [
        ([37], 4, 4, 64, 8, 1),  # one sequence, MHA, D=64
        ([37], 16, 1, 64, 8, 4),  # GQA 16 (MQA), splits of 16 keys
        ([3, 50], 6, 2, 40, 4, 5),  # D=40 (padded to 64), odd group 3, some splits empty
    ],
)
def test_decode_shapes(lens, hq, hkv, d, bs, num_splits):
    gen = torch.Generator().manual_seed(len(lens) + hq)
    cache = filled_cache(FP8, 32, bs, hkv, d, gen)
    table = block_tables(lens, bs, 32, gen)
    q = torch.randn(len(lens), hq, d, generator=gen)
    args = (q, *cache.args(), table, torch.tensor(lens, dtype=torch.int32), 0.3)
    out = decode.paged_decode_attention(*args, num_splits=num_splits, block_n=16)
    _assert_close(out, reference.paged_decode_attention(*args), torch.float32)


def test_decode_without_descale_would_fail():
    """Guards the test itself: dropping the FP8 scales changes the output far beyond tol."""
    gen = torch.Generator().manual_seed(3)
    cache = filled_cache(FP8, 8, 16, 2, 32, gen)
    table = block_tables([70], 16, 8, gen)
    q = torch.randn(1, 4, 32, generator=gen)
    lens = torch.tensor([70], dtype=torch.int32)
    out = decode.paged_decode_attention(q, *cache.args(), table, lens, 0.2)
    zero = torch.zeros_like(cache.k_scale)
    wrong = reference.paged_decode_attention(q, cache.k, cache.v, zero, zero, table, lens, 0.2)
    assert (out - wrong).abs().max() > 100 * ATTN_TOL[torch.float32][0]


def test_choose_num_splits():
    assert decode.choose_num_splits(64, 8, 32768) == 1  # batch fills the GPU twice over
    assert decode.choose_num_splits(1, 8, 512) == 1  # short context
    assert decode.choose_num_splits(1, 8, 32768) == decode.MAX_SPLITS
    assert decode.choose_num_splits(4, 8, 4096) == 4096 // decode.MIN_SPLIT_KEYS
    assert decode.choose_num_splits(8, 8, 32768, num_sms=132) == 9  # ~4 programs per SM
    assert decode.default_block_n(torch.zeros(1, dtype=FP8)) == 64
    assert decode.default_block_n(torch.zeros(1, dtype=torch.bfloat16)) == 32


def _prefill_case(cache_dtype, q_dtype, lens, qlens, hq, hkv, d, bs, gen):
    cache = filled_cache(cache_dtype, 40, bs, hkv, d, gen)
    table = block_tables(lens, bs, 40, gen)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(qlens), hq, d, generator=gen).to(q_dtype)
    return (q, *cache.args(), table, qsl, torch.tensor(lens, dtype=torch.int32), d**-0.5)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_prefill_matches_reference(cache_dtype, q_dtype):
    gen = torch.Generator().manual_seed(5)
    # full prefill (5 of 5), extend after a prefix (3 new of 70), a 40-token chunk over 133
    args = _prefill_case(cache_dtype, q_dtype, [5, 70, 133], [5, 3, 40], 4, 2, 32, 16, gen)
    out = prefill.paged_prefill_attention(*args, block_m=16, block_n=16)
    _assert_close(out, reference.paged_prefill_attention(*args), q_dtype)


def test_prefill_one_sequence_gqa8():
    gen = torch.Generator().manual_seed(6)
    args = _prefill_case(FP8, torch.float32, [45], [45], 8, 1, 64, 8, gen)
    out = prefill.paged_prefill_attention(*args, block_m=16, block_n=32)
    _assert_close(out, reference.paged_prefill_attention(*args), torch.float32)


@pytest.mark.parametrize("cache_dtype", [FP8, torch.float16])
def test_chunked_prefill_equals_full_prefill(cache_dtype):
    """Write-then-read: two chunks (kv_write + prefill each) give the full prefill's output,
    and a decode step after it matches the reference on the Triton-written cache."""
    gen = torch.Generator().manual_seed(7)
    n, hq, hkv, d, bs = 29, 4, 2, 32, 8
    k, v = random_kv(n, hkv, d, gen)
    q = torch.randn(n, hq, d, generator=gen)
    table = block_tables([n], bs, 8, gen)
    slots = (table[0, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs).long()

    def run(chunks):
        cache, outs, done = empty_cache(cache_dtype, 8, bs, hkv, d), [], 0
        for c in chunks:
            sl = slice(done, done + c)
            kv_write_triton(k[sl], v[sl], *cache.args(), slots[sl])
            done += c
            qsl = torch.tensor([0, c], dtype=torch.int32)
            lens = torch.tensor([done], dtype=torch.int32)
            args = (q[sl], *cache.args(), table, qsl, lens, d**-0.5)
            outs.append(prefill.paged_prefill_attention(*args, block_m=16, block_n=16))
        return torch.cat(outs), cache

    full, cache = run([n])
    chunked, _ = run([11, n - 11])
    _assert_close(chunked, full, torch.float32)
    lens = torch.tensor([n], dtype=torch.int32)
    dec_args = (q[-1:], *cache.args(), table, lens, d**-0.5)
    _assert_close(decode.paged_decode_attention(*dec_args), full[-1:], torch.float32)
    _assert_close(reference.paged_decode_attention(*dec_args), full[-1:], torch.float32)


def test_fp8_as_bits_path(monkeypatch):
    """GPUs without native e4m3 (A100) get the cache as uint8 and decode bits in-kernel."""
    from slimserve_kernels import attn_common

    monkeypatch.setattr(attn_common, "fp8_native", lambda t: False)
    gen = torch.Generator().manual_seed(8)
    args = _prefill_case(FP8, torch.float16, [9, 70], [9, 20], 4, 2, 32, 16, gen)
    out = prefill.paged_prefill_attention(*args, block_m=16, block_n=16)
    _assert_close(out, reference.paged_prefill_attention(*args), torch.float16)
    q, kc, vc, ks, vs, table, _, lens, scale = args
    dec = (q[:2].float(), kc, vc, ks, vs, table, lens, scale)
    out = decode.paged_decode_attention(*dec, num_splits=2, block_n=16)
    _assert_close(out, reference.paged_decode_attention(*dec), torch.float32)
