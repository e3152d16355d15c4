"""The C++ CPU float32 linear (slimserve_kernels/cpu_linear.py) against F.linear in float64,
its batch invariance, and its use by the model's linears (app/models/layers.py).

Tolerance: the kernel sums K fp32 products in one chain; against the float64 result the
error is a few ulps times sqrt(K) of O(1) values: 1e-4 absolute and relative at K <= 1000.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from app.models.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    pack_cpu_linears,
    unpack_cpu_linears,
)
from slimserve_kernels import cpu_build, cpu_linear

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_linear.available():
        pytest.skip("the C++ CPU kernel did not build here (test_failed_build_falls_back)")


def reference(x, w, b=None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("m", [1, 3, 8, 17, 32, 65, 512])
@pytest.mark.parametrize("k,n", [(256, 512), (77, 33), (13, 100), (768, 256), (40, 5)])
def test_matches_float64_reference(m, k, n):
    """Any M (8-row tiles, then 1-7 rows over 4 / 2 / 1 panels at a time), K not a multiple
    of 16, N with a partial last panel; packed panels and a column-major W in place."""
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
    ref = reference(x, w, b)
    column_major = w.t().contiguous().t()
    for weights in (cpu_linear.pack(w), column_major):
        torch.testing.assert_close(cpu_linear.linear(x, weights, n, b), ref, **TOL)
    torch.testing.assert_close(cpu_linear.linear(x, cpu_linear.pack(w), n), reference(x, w), **TOL)


def test_pack_layout_is_panels_of_32_zero_padded():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    p = cpu_linear.pack(w)
    assert p.shape == (3, 3, 32)
    assert torch.equal(p[1, 2, 5], w[37, 2]) and torch.equal(p[2, :, 6:], torch.zeros(3, 26))


def test_strided_and_batched_inputs():
    """x a column slice (row stride != K), a transposed view, and [B, T, K]."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 24, generator=g)
    packed = cpu_linear.pack(w)
    wide = torch.randn(9, 40, generator=g)
    for x in (wide[:, 5:29], torch.randn(24, 9, generator=g).t(), torch.randn(2, 5, 24)):
        y = cpu_linear.linear(x, packed, 48)
        assert y.shape == (*x.shape[:-1], 48)
        torch.testing.assert_close(y, reference(x, w), **TOL)


def test_a_row_gives_the_same_bits_in_any_batch_and_thread_count():
    """Batch invariance: one FMA chain per output in k order whatever M, the row's place in
    a tile or the threads (aten's GEMM changes kernels and blockings with M)."""
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(1000, 256, generator=g), torch.randn(1000, generator=g)
    packed = cpu_linear.pack(w)
    x = torch.randn(33, 256, generator=g)
    alone = torch.cat([cpu_linear.linear(x[i : i + 1], packed, 1000, b) for i in range(33)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (33, 9, 3, 2):
                assert torch.equal(cpu_linear.linear(x[:rows], packed, 1000, b), alone[:rows])
    finally:
        torch.set_num_threads(threads)


def test_row_blocks_and_shares_give_the_reference_bits_at_any_thread_count():
    """Batches of many row blocks (256 rows) and a partial one, split into one share of tasks
    per thread, shares taken from each other's backs: the same bits as one thread computing
    it all, at 2 threads and at more threads than cores (threads then run late and the
    others take what they have not started). Packed and column-major W (its partial last
    panel through a scratch copy), contiguous and strided x; two inputs alternate, so a
    task left undone cannot pass on the last call's output."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    rows = 16 * 256 + 100  # 17 row blocks x 2 chunks of panels
    wide = torch.randn(rows, 120, generator=g)
    xs = (torch.randn(rows, 96, generator=g), wide[:, 7:103])
    threads = torch.get_num_threads()
    try:
        for weights in (cpu_linear.pack(w), w.t().contiguous().t()):
            torch.set_num_threads(1)
            alone = [cpu_linear.linear(x, weights, 200, b) for x in xs]
            for x, y in zip(xs, alone, strict=True):
                torch.testing.assert_close(y, reference(x, w, b), **TOL)
            for t in (2, 3, 8):
                torch.set_num_threads(t)
                for i in range(6):
                    got = cpu_linear.linear(xs[i % 2], weights, 200, b)
                    assert torch.equal(got, alone[i % 2])
    finally:
        torch.set_num_threads(threads)


def test_a_thread_runs_its_share_then_takes_from_the_back_of_the_others():
    """The GEMM's work split (`Shares`): tasks 0..9 in two shares, [0, 5) and [5, 10). A
    thread runs its own share front to back, then takes the other's tasks from its back, so
    a thread held up by another process loses only what it had not started; each task is
    handed out once. Seen failing with a steal that took the wrong task."""
    claims = cpu_linear.load().shares_claims
    # thread 0 alone: its share, then thread 1's from the back; then nothing for anyone
    assert claims(10, 2, [0] * 11 + [1]) == [0, 1, 2, 3, 4, 9, 8, 7, 6, 5, -1, -1]
    # interleaved: each from its own front until a share runs dry, then from the other's back
    assert claims(10, 2, [0, 1, 0, 1, 1, 1, 1, 0, 1, 0]) == [0, 5, 1, 6, 7, 8, 9, 2, 4, 3]
    assert claims(10, 2, [1] * 7) == [5, 6, 7, 8, 9, 4, 3]
    # three shares of 7 tasks ([0, 2), [2, 4), [4, 7)): a steal tries the next share first
    assert claims(7, 3, [2, 2, 2, 2, 2, 2, 2, 2]) == [4, 5, 6, 1, 0, 3, 2, -1]
    # more threads than tasks: empty shares go straight to the others'
    assert claims(2, 4, [3, 3, 3]) == [1, 0, -1]
    order = [0, 2, 1, 1, 1, 0, 2, 0, 1, 2, 1, 0, 0]
    got = claims(23, 3, order * 3)
    assert sorted(t for t in got if t >= 0) == list(range(23))
    with pytest.raises(RuntimeError, match="out of range"):
        claims(4, 2, [2])


def test_bad_inputs_raise():
    w = torch.randn(40, 16)
    with pytest.raises(RuntimeError, match="packed W"):
        cpu_linear.linear(torch.randn(2, 16), cpu_linear.pack(w)[:1].contiguous(), 40)
    with pytest.raises(RuntimeError, match="column-major"):
        cpu_linear.linear(torch.randn(2, 16), w, 40)  # row-major W
    with pytest.raises(RuntimeError, match="bias"):
        cpu_linear.linear(torch.randn(2, 16), cpu_linear.pack(w), 40, torch.randn(39))


def _layers():
    torch.manual_seed(3)
    col, row = ColumnParallelLinear(40, 70, bias=True), RowParallelLinear(70, 24, bias=True)
    head = ParallelLMHead(100, 24)
    for p in (*col.parameters(), *row.parameters(), *head.parameters()):
        p.data.normal_()
    model = torch.nn.ModuleList([col, row, head])
    return model, lambda x: head(row(col(x)))


def test_model_linears_use_the_kernel_and_its_off_switch(monkeypatch):
    """pack_cpu_linears gives the column, row and LM-head linears panels; their forward then
    runs the kernel (its bits, not F.linear's); unpack_cpu_linears takes F.linear again, and
    with SLIMSERVE_CPU_KERNELS=0 nothing is packed. The Parameters stay as they were."""
    model, forward = _layers()
    weights = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 40)
    with torch.inference_mode():
        plain = forward(x)
        assert pack_cpu_linears(model) == 3
        col, row, head = model
        h = cpu_linear.linear(x, col.packed, 70, col.bias)
        h = cpu_linear.linear(h, row.packed, 24) + row.bias
        assert torch.equal(forward(x), cpu_linear.linear(h, head.packed, 100))
        torch.testing.assert_close(forward(x), plain, **TOL)
        assert unpack_cpu_linears(model) == 3
        assert torch.equal(forward(x), plain)
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    monkeypatch.setenv(cpu_linear.ENV, "0")
    assert pack_cpu_linears(model) == 0 and all(m.packed is None for m in model)


def test_failed_build_falls_back(monkeypatch, caplog):
    """No compiler (the build raises): available() is False with one warning, nothing is
    packed, and the linears keep F.linear."""

    def no_compiler(*args):
        raise RuntimeError("no c++ compiler")

    monkeypatch.setattr(cpu_build, "build", no_compiler)
    cpu_linear.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_linear.__name__):
            assert not cpu_linear.available() and not cpu_linear.available()
        assert sum("build failed" in r.message for r in caplog.records) == 1
        model, forward = _layers()
        assert pack_cpu_linears(model) == 0 and all(m.packed is None for m in model)
        forward(torch.randn(2, 40))
    finally:
        cpu_linear.load.cache_clear()  # the next test builds (loads from the cache) again
