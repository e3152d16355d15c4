"""The vectorized CPU decode attention equals the reference, FP8 and full precision.

The per-step path (prepare_decode + decode_layer) runs twice: with the C++ kernel (where it
builds) and with SLIMSERVE_CPU_KERNELS=0, the PyTorch gather + SDPA path it falls back to."""

import logging

import pytest
import torch

from app.engine import torch_attention
from slimserve_kernels import cpu_build, cpu_paged, reference


@pytest.fixture(params=["kernel", "torch"])
def step_path(request, monkeypatch):
    """Which attention decode_layer runs: the C++ kernel or the PyTorch fallback."""
    if request.param == "torch":
        monkeypatch.setenv(cpu_paged.ENV, "0")
    elif not cpu_paged.available():
        pytest.skip("the C++ CPU kernel did not build here")
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    """The PyTorch path (its mask and gather rows are what these tests check)."""
    monkeypatch.setenv(cpu_paged.ENV, "0")


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


def twin_caches(dtype, nb: int, bs: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple]:
    """Two identical paged caches (K, V[, K scales, V scales]) of nb blocks of bs tokens,
    every slot written with k / v [nb * bs, Hkv, D]: one for the reference, one for the path
    under test."""
    fp8, hkv, d = dtype == torch.float8_e4m3fn, k.shape[1], k.shape[2]
    caches = []
    for _ in range(2):
        kc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
        scales = [torch.zeros(nb, bs, hkv, dtype=torch.int8) if fp8 else None for _ in "kv"]
        caches.append((kc, torch.zeros_like(kc), *scales))
        reference.kv_write(k, v, *caches[-1], torch.arange(nb * bs))
    return caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn, torch.bfloat16])
def test_decode_layer_matches_write_then_attend(dtype, step_path):
    """The per-step context path (prepare_decode once, decode_layer per layer) writes the
    same cache and returns the same output as the reference kv_write + decode attention; a
    slot < 0 (a padding row) writes nothing. bf16: the kernel attends, torch ops write (the
    slots found at the first layer).
    Seen failing: with the -1 slot written as-is (index_copy_ of every row: IndexError)."""
    torch.manual_seed(1)
    nb, bs, hkv, hq, d = 12, 4, 2, 6, 16
    old = torch.randn(nb * bs, hkv, d)
    caches = twin_caches(dtype, nb, bs, old, old * 2)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 16, 1], dtype=torch.int32)
    slots = torch.tensor([1 * bs + 1, 11 * bs + 3, -1])  # the third row is padding
    q, k, v = torch.randn(3, hq, d), torch.randn(3, hkv, d), torch.randn(3, hkv, d)
    reference.kv_write(k, v, *caches[0], slots)
    want = reference.paged_decode_attention(q, *caches[0], tables, lens, d**-0.5)
    ctx = torch_attention.prepare_decode(tables, lens, slots, bs)
    assert (ctx.kernel is not None) == (step_path == "kernel")
    got = torch_attention.decode_layer(ctx, q, k, v, *caches[1], d**-0.5)
    for a, b in zip(caches[0], caches[1]):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    torch.testing.assert_close(got[:2], want[:2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_short_extend_matches_reference_prefill(dtype, step_path):
    """A step with several new tokens per sequence (a speculative verify step: 1 + k rows,
    k differing per sequence; a short chunk) through the batched path writes the same cache
    and returns what the reference's kv_write + per-sequence causal prefill returns.
    GQA group 3, queries of 3, 1 and 5 rows (padding inside the batch), one of them the
    sequence's first tokens.
    Seen failing: with the padded query rows ordered (g, j) instead of (j, g) (wrong rows'
    masks), and with every query seeing the whole step (no causal mask within it)."""
    torch.manual_seed(2)
    nb, bs, hkv, hq, d = 12, 4, 2, 6, 16
    old = torch.randn(nb * bs, hkv, d) * 2
    caches = twin_caches(dtype, nb, bs, old, old * 0.5)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 6, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 16, 5], dtype=torch.int32)
    n_new = [3, 1, 5]
    starts = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    slots = []
    for table, n, length in zip(tables.tolist(), n_new, lens.tolist()):
        slots += [table[p // bs] * bs + p % bs for p in range(length - n, length)]
    slots = torch.tensor(slots)
    t = len(slots)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    reference.kv_write(k, v, *caches[0], slots)
    want = reference.paged_prefill_attention(q, *caches[0], tables, starts, lens, d**-0.5)
    ctx = torch_attention.prepare_decode(tables, lens, slots, bs, starts)
    assert (ctx.kernel is not None) == (step_path == "kernel")
    got = torch_attention.decode_layer(ctx, q, k, v, *caches[1], d**-0.5)
    for a, b in zip(caches[0], caches[1]):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_long_fp8_prefill_runs_the_kernel_and_matches_reference():
    """A long chunked prefill over an FP8 cache (300 new tokens after 200 cached, and a
    whole 260-token prompt beside it) goes to the C++ kernel, not the reference, and
    returns the reference's causal prefill. Seen failing with KERNEL_MAX_QUERY_FP8 = 128
    (no kernel context) and with the kernel given no query_start_loc (no causal rows)."""
    if not cpu_paged.available():
        pytest.skip("the C++ CPU kernel did not build here")
    torch.manual_seed(3)
    nb, bs, hkv, hq, d = 64, 16, 2, 4, 16
    old = torch.randn(nb * bs, hkv, d) * 2
    caches = twin_caches(torch.float8_e4m3fn, nb, bs, old, old * 0.5)
    tables = torch.stack([torch.arange(32), torch.arange(32, 64)]).int()
    lens = torch.tensor([500, 260], dtype=torch.int32)
    n_new = [300, 260]
    starts = torch.tensor([0, 300, 560], dtype=torch.int32)
    slots = []
    for table, n, length in zip(tables.tolist(), n_new, lens.tolist()):
        slots += [table[p // bs] * bs + p % bs for p in range(length - n, length)]
    slots = torch.tensor(slots)
    t = len(slots)
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    reference.kv_write(k, v, *caches[0], slots)
    want = reference.paged_prefill_attention(q, *caches[0], tables, starts, lens, d**-0.5)
    assert torch_attention.prepare_decode(tables, lens, slots, bs, starts) is None  # 32-bit
    ctx = torch_attention.prepare_decode(tables, lens, slots, bs, starts, fp8_cache=True)
    assert ctx is not None and ctx.kernel is not None
    got = torch_attention.decode_layer(ctx, q, k, v, *caches[1], d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_long_extend_declines_batched_path(step_path):
    """A query longer than the batched path takes (MAX_BATCHED_QUERY rows for the padded
    torch path, KERNEL_MAX_QUERY for the C++ kernel with a 16/32-bit cache: a long
    prefill) is left to the reference; one row shorter is not."""
    limit = {"torch": torch_attention.MAX_BATCHED_QUERY, "kernel": torch_attention.KERNEL_MAX_QUERY}
    n = limit[step_path] + 1
    tables = torch.arange(2 * (n // 4 + 2), dtype=torch.int32).view(2, -1)
    lens = torch.tensor([n, 2], dtype=torch.int32)
    starts = torch.tensor([0, n, n + 1], dtype=torch.int32)
    slots = torch.arange(n + 1)
    assert torch_attention.prepare_decode(tables, lens, slots, 4, starts) is None
    starts = torch.tensor([0, n - 1, n], dtype=torch.int32)
    assert torch_attention.prepare_decode(tables, lens - 1, slots[:-1], 4, starts) is not None


def test_decode_mask_equals_the_general_one_row_per_sequence_form(torch_path):
    """prepare_decode's decode shortcut (no query_start_loc) builds the mask the general
    path builds for one new token per sequence. Seen failing with `>` for `>=` (each
    sequence's last key masked)."""
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 16, 1], dtype=torch.int32)
    slots = torch.tensor([1 * 4 + 1, 11 * 4 + 3, 4 * 4])
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    short = torch_attention.prepare_decode(tables, lens, slots, 4)
    general = torch_attention.prepare_decode(tables, lens, slots, 4, starts)
    assert torch.equal(short.mask, general.mask) and short.mask.shape == (3, 1, 1, 16)
    assert torch.equal(short.rows, general.rows) and torch.equal(short.slots, general.slots)


def test_failed_build_falls_back(monkeypatch, caplog):
    """No compiler (the build raises): available() is False with one warning, and the
    engine's per-step path takes the PyTorch attention."""

    def no_compiler(*args):
        raise RuntimeError("no c++ compiler")

    monkeypatch.setattr(cpu_build, "build", no_compiler)
    cpu_paged.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_paged.__name__):
            assert not cpu_paged.available() and not cpu_paged.available()
        assert sum("build failed" in r.message for r in caplog.records) == 1
        tables = torch.tensor([[0, 1]], dtype=torch.int32)
        ctx = torch_attention.prepare_decode(tables, torch.tensor([5]), torch.tensor([4]), 4)
        assert ctx.kernel is None and ctx.mask is not None
    finally:
        cpu_paged.load.cache_clear()  # the next test builds (loads from the cache) again
