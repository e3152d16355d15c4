"""The C++ CPU paged attention (slimserve_kernels/cpu_paged.py) against the PyTorch reference.

Tolerance: both accumulate in fp32 but in different orders (the kernel's online softmax,
16-lane partial dot products summed by a tree) and the kernel's exp is a polynomial within
~2 ulp of expf; outputs are O(1), so 1e-5 relative and absolute (the kernel's largest
difference from the reference in the decode tests is 3.7e-6). FP8 decoding is
checked exactly: a sequence of one key returns that key's V row, i.e. every e4m3 code's
value (NaN codes included) times 2**exponent, bit for bit.
"""

import os

import pytest
import torch
from isa_rerun import rerun_under_isa

from slimserve_kernels import cpu_paged, reference
from slimserve_kernels.fp8_cpu import fp8_values

FP8 = torch.float8_e4m3fn
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_paged.available():
        pytest.skip("the C++ CPU kernel did not build here (tests/engine tests the fallback)")


def paged_cache(dtype, lens, bs: int, hkv: int, d: int, seed: int):
    """A cache holding sequences of `lens` tokens in shuffled blocks, tables padded with -1;
    K rows carry per-token magnitudes 2**-4..2**4 so FP8 exponents differ per token.
    -> (k_cache, v_cache, k_scale, v_scale, block_tables [B, maxb] int32)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3  # spare blocks that no table names
    k = torch.randn(nb * bs, hkv, d, generator=g)
    k *= torch.exp2(torch.randint(-4, 5, (nb * bs, hkv, 1), generator=g).float())
    v = torch.randn(nb * bs, hkv, d, generator=g)
    kc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    scales = [torch.zeros(nb, bs, hkv, dtype=torch.int8) if dtype == FP8 else None for _ in "kv"]
    reference.kv_write(k, v, kc, vc, *scales, torch.arange(nb * bs))
    order = torch.randperm(nb, generator=g).int()
    tables = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[at : at + n]
        at += n
    return kc, vc, *scales, tables


DTYPES = [torch.float32, FP8, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_matches_reference(dtype, group, d):
    """Lengths 1, bs - 1, bs + 1 and long (odd) in one batch, shuffled tables."""
    bs, hkv = 16, 2
    lens = [1, bs - 1, bs + 1, 301, 2 * bs]
    cache = paged_cache(dtype, lens, bs, hkv, d, seed=group * d)
    lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(d))
    args = (q, *cache)
    # sm_scale keeps scores below ~10: fp32 rounding of a score x is ~x * 6e-8 in both, and
    # exp() turns that into a relative error of the probabilities
    want = reference.paged_decode_attention(*args, lens, 0.05)
    got = cpu_paged.paged_attention_cpu(*args, lens, None, 0.05)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
@pytest.mark.parametrize("block_size", [5, 16])
def test_extend_matches_reference_prefill(dtype, block_size):
    """Several causal query rows per sequence (a verify step, a short chunk, a prefill): 3,
    1, 5, 17 and 100 new tokens, two sequences all new (a prefill of their first tokens)."""
    hkv, group, d = 2, 3, 64
    lens = [40, 7, 5, 90, 100]
    n_new = [3, 1, 5, 17, 100]
    cache = paged_cache(dtype, lens, block_size, hkv, d, seed=block_size)
    starts = torch.tensor([0, *torch.tensor(n_new).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(n_new), hkv * group, d, generator=torch.Generator().manual_seed(1))
    want = reference.paged_prefill_attention(q, *cache, starts, lens, 0.05)
    got = cpu_paged.paged_attention_cpu(q, *cache, lens, starts, 0.05)
    torch.testing.assert_close(got, want, **TOL)


def test_fp8_decode_is_exact_for_every_code():
    """One key per sequence: the output is its V row, so every e4m3 code (NaN codes 0x7f and
    0xff included) times 2**e must come back as fp8_values(code) * 2**e, bit for bit."""
    d, bs, exps = 64, 4, [-100, -7, 0, 3, 100]
    codes = torch.arange(256, dtype=torch.uint8).view(-1, d)  # [4, 64]: 4 rows of codes
    n = codes.shape[0] * len(exps)  # one sequence per (row of codes, exponent)
    vc = torch.zeros(n, bs, 1, d, dtype=torch.uint8)
    vc[:, 0, 0] = codes.repeat(len(exps), 1)
    vs = torch.zeros(n, bs, 1, dtype=torch.int8)
    vs[:, 0, 0] = torch.tensor(exps, dtype=torch.int8).repeat_interleave(codes.shape[0])
    vc = vc.view(FP8)
    kc, ks = torch.zeros_like(vc), torch.zeros_like(vs)
    tables = torch.arange(n, dtype=torch.int32).view(n, 1)
    lens = torch.ones(n, dtype=torch.int32)
    got = cpu_paged.paged_attention_cpu(
        torch.randn(n, 1, d), kc, vc, ks, vs, tables, lens, None, 1.0
    )
    want = fp8_values(vc[:, 0], torch.float32) * torch.exp2(vs[:, 0].float()).unsqueeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.isnan().sum() == 2 * len(exps)


def test_isa_is_the_cap():
    """Under SLIMSERVE_CPU_ISA (set by the test below in a subprocess) the kernel runs the
    capped copy; without it, the CPU's best (AVX-512 on the machines this runs on, x86-64)."""
    want = os.environ.get("SLIMSERVE_CPU_ISA")
    if want is None:
        pytest.skip("runs under test_other_instruction_set_copies_match_the_reference")
    assert cpu_paged.load().isa() == want


@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_other_instruction_set_copies_match_the_reference(isa):
    """The AVX2 (F16C FP8 decode) and baseline (integer FP8 decode) copies, which other CPUs
    pick, run here too: SLIMSERVE_CPU_ISA caps the pick when the module loads, so the decode,
    extend, every-code and view tests run again in a subprocess under each cap."""
    if cpu_paged.load().isa() == "baseline" and isa == "avx2":
        pytest.skip("this CPU has no AVX2")
    tests = "decode_matches or extend_matches or every_code or strided or isa_is_the_cap"
    rerun_under_isa(__file__, isa, tests, 31)


def test_threads_give_the_same_bits():
    """A row's result does not depend on the thread that runs its task, so the thread count
    cannot change it: decodes, and a step mixing a 300-token prefill (split into blocks of
    query rows) with decodes."""
    lens = [33, 1, 200, 64, 300]
    *planes, tables = paged_cache(FP8, lens, 16, 4, 64, seed=3)
    lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, 1, 2, 3, 4, 304], dtype=torch.int32)
    decode = (torch.randn(4, 8, 64), tables[:4], lens[:4], None)
    mixed = (torch.randn(304, 8, 64), tables, lens, starts)
    threads = torch.get_num_threads()
    try:
        for q, table, seq_lens, query_start in (decode, mixed):
            args = (q, *planes, table, seq_lens, query_start, 0.125)
            torch.set_num_threads(1)
            one = cpu_paged.paged_attention_cpu(*args)
            torch.set_num_threads(2)
            two = cpu_paged.paged_attention_cpu(*args)
            assert torch.equal(one, two)
    finally:
        torch.set_num_threads(threads)


def test_strided_query_and_cache_views():
    """q a view of a wider [T, Hq + 2, D] tensor and the cache one layer of an engine-style
    [L, 2, ...] allocation (not contiguous past D)."""
    torch.manual_seed(0)
    bs, hkv, d = 8, 2, 64
    kv = torch.randn(2, 2, 6, bs, hkv, d)
    kc, vc = kv[1, 0], kv[1, 1]
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([17, 24], dtype=torch.int32)
    q = torch.randn(2, 6, d)[:, 1:5]
    want = reference.paged_decode_attention(q, kc, vc, None, None, tables, lens, 0.2)
    got = cpu_paged.paged_attention_cpu(q, kc, vc, None, None, tables, lens, None, 0.2)
    torch.testing.assert_close(got, want, **TOL)


def test_bad_inputs_raise():
    kc = torch.zeros(2, 4, 1, 16, dtype=FP8)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="int8 scales"):
        cpu_paged.load().paged_attention(q, kc, kc, None, None, tables, lens, None, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_paged.paged_attention_cpu(
            q, kc.float(), kc.float(), None, None, tables.long(), lens, None, 1.0
        )


def kv_write_rows(seed: int, t: int, hkv: int, d: int) -> torch.Tensor:
    """[t, Hkv, D] rows that hit the quantizer's edges: magnitudes 2**-30..2**30, an all-zero
    row, rows whose amax is exactly 448 * 2**e and one ulp above, and e4m3 rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hkv, d, generator=g)
    x *= torch.exp2(torch.randint(-30, 31, (t, hkv, 1), generator=g).float())
    x[0, 0] = 0.0
    x[1, 0, 0] = 448.0 * 2.0**3
    x[2, 0, 0] = torch.nextafter(torch.tensor(448.0 * 2.0**-5), torch.tensor(1e9))
    x[3, 0, :8] = torch.tensor([1.0625, 1.1875, -1.0625, 0.0029296875, 9.0, 11.0, 13.0, 448.0])
    return x


@pytest.mark.parametrize("dtype", [torch.float32, FP8])
def test_kv_write_is_bit_identical_to_reference(dtype):
    """Cache bytes and exponents equal the reference's; slots < 0 write nothing."""
    nb, bs, hkv, d, t = 6, 4, 2, 64, 16
    k, v = kv_write_rows(0, t, hkv, d), kv_write_rows(1, t, hkv, d)
    slots = torch.randperm(nb * bs)[:t]
    slots[[5, 11]] = -1
    caches = []
    for _ in range(2):
        kc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
        scales = [
            torch.zeros(nb, bs, hkv, dtype=torch.int8) if dtype == FP8 else None for _ in "kv"
        ]
        caches.append((kc, torch.zeros_like(kc), *scales))
    reference.kv_write(k, v, *caches[0], slots)
    cpu_paged.kv_write_cpu(k, v, *caches[1], slots)
    for want, got in zip(*caches):
        if want is not None:
            assert torch.equal(want.view(torch.uint8), got.view(torch.uint8))
    assert bool(caches[1][0].float().abs().sum() > 0)


def test_kv_write_rejects_a_slot_past_the_cache():
    kc = torch.zeros(2, 4, 1, 16)
    k = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_paged.kv_write_cpu(k, k, kc, kc.clone(), None, None, torch.tensor([8]))
