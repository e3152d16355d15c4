"""Every C++ CPU kernel runs without the GIL (`kNoGil` in csrc/*.cpp), as ATen's own bindings
do: a served replica's event loop must keep taking requests and sending deltas while its
step thread is inside a kernel.

How it is seen without a clock: the interpreter's switch interval is raised to 60 s, so
while the calling thread holds the GIL no other Python thread can run. A second thread
waits for the GIL and, once it has it, records where the caller was: inside a kernel call,
or between calls (freeing a large result can let it in too, seen with a kernel that keeps
the GIL: such a run says nothing, and the probe starts over with a new thread). A kernel
that keeps the GIL never lets it in during a call."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
import torch

from slimserve_kernels import cpu_fused, cpu_linear, cpu_paged, cpu_tag

CALLS, ATTEMPTS = 1000, 5


def _attempt(call: Callable[[], object]) -> str | None:
    """Where the caller was when another thread first ran: "call", "between", or None."""
    where = {"now": "between"}
    seen: list[str] = []
    go = threading.Event()
    other = threading.Thread(target=lambda: (go.wait(), seen.append(where["now"])), daemon=True)
    other.start()
    go.set()  # from here the other thread only needs the GIL
    for _ in range(CALLS):
        where["now"] = "call"
        result = call()
        where["now"] = "between"
        del result
        if seen:
            break
    other.join(timeout=60)
    return seen[0] if seen else None


def another_thread_ran_during(call: Callable[[], object]) -> bool:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        for _ in range(ATTEMPTS):
            where = _attempt(call)
            if where != "between":
                return where == "call"
        return False
    finally:
        sys.setswitchinterval(interval)


def _need(module) -> object:
    if not module.available():
        pytest.skip(f"{module.__name__}'s C++ kernel did not build here")
    return module.load()


def test_linear_releases_the_gil():
    ext = _need(cpu_linear)
    w = torch.randn(1024, 512)
    packed, x = ext.pack(w), torch.randn(64, 512)
    assert another_thread_ran_during(lambda: ext.linear(x, packed, 1024, None))
    assert another_thread_ran_during(lambda: ext.pack(w))


def test_fused_ops_release_the_gil():
    ext = _need(cpu_fused)
    lanes = cpu_fused.vec_lanes()
    x, w = torch.randn(512, 256), torch.randn(256)
    assert another_thread_ran_during(lambda: ext.rms_norm(x, w, 1e-5, cpu_fused.SUM_LANES))
    residual = torch.randn(512, 256)
    assert another_thread_ran_during(
        lambda: ext.add_rms_norm(x, residual, w, 1e-5, cpu_fused.SUM_LANES)
    )
    gate_up = torch.randn(512, 512)
    assert another_thread_ran_during(lambda: ext.silu_and_mul(gate_up, lanes))
    q, cos, sin = torch.randn(512, 4, 64), torch.randn(600, 64), torch.randn(600, 64)
    positions = torch.arange(512)
    assert another_thread_ran_during(lambda: ext.rotary_(q, positions, cos, sin))


def test_paged_attention_and_kv_write_release_the_gil():
    ext = _need(cpu_paged)
    blocks, bs, hkv, d, batch = 512, 16, 2, 64, 32  # 256-token contexts
    kc, vc = torch.randn(blocks, bs, hkv, d), torch.randn(blocks, bs, hkv, d)
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, blocks // batch)
    lens = torch.full((batch,), bs * blocks // batch, dtype=torch.int32)
    q = torch.randn(batch, 2 * hkv, d)
    assert another_thread_ran_during(
        lambda: ext.paged_attention(q, kc, vc, None, None, tables, lens, None, 0.125)
    )
    k, v = torch.randn(batch, hkv, d), torch.randn(batch, hkv, d)
    slots = torch.arange(batch, dtype=torch.int64)
    assert another_thread_ran_during(lambda: ext.kv_write(k, v, kc, vc, None, None, slots))


def test_kv_chunk_copies_and_their_tag_release_the_gil():
    """The transfer worker copies a chunk while the step thread and the event loop run.
    The extension is called directly: the Python wrappers make tensors, which can let
    another thread in outside the kernel.

    Seen failing: with copy_blocks' GIL release commented out."""
    ext = _need(cpu_tag)
    state = ext.state_new()
    src = torch.randint(0, 255, (4, 2, 1 << 16), dtype=torch.uint8)
    dst = torch.empty(1 << 19, dtype=torch.uint8)
    assert another_thread_ran_during(lambda: ext.update(state, src))
    assert another_thread_ran_during(lambda: ext.copy(state, dst, src))
    assert another_thread_ran_during(lambda: ext.copy_planes(state, dst, src))
    cache = torch.empty(4, 2, 16, 16, 256, dtype=torch.uint8)  # 16 blocks of 16 tokens
    runs = torch.tensor([[0, 0, 16]], dtype=torch.int64)
    assert another_thread_ran_during(lambda: ext.copy_blocks(state, src, cache, runs))
    assert another_thread_ran_during(lambda: ext.copy_blocks(None, src, cache, runs))


def test_the_probe_sees_a_call_that_keeps_the_gil():
    """The probe's negative: pure Python work (the GIL held throughout) lets no thread in."""
    assert not another_thread_ran_during(lambda: sum(range(2000)))
