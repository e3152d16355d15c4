"""bench/moe_cpu.py at a tiny shape: both paths run on the same stacks and agree."""

from __future__ import annotations

import pytest

from bench import moe_cpu


@pytest.mark.parametrize("kind", ["dense", "fp8"])
def test_fused_and_loop_agree_on_shared_stacks(monkeypatch, kind):
    """The bench's experts share one storage, so this checks its plumbing (stacks, views,
    FP8 modules, routing weights), not expert indexing (test_triton_fused_moe.py does).
    Seen to fail: routing weights read in reversed row order in `fused_moe_torch`."""
    monkeypatch.setitem(moe_cpu.SHAPES, "tiny", (256, 128, 12))
    rows = moe_cpu.bench_shape("tiny", kind, [1, 5], reps=1)
    assert [r["tokens"] for r in rows] == [1, 5]
    assert all(r["rel_err"] < 1e-5 and r["fused_cpu_ms"] > 0 for r in rows)
    assert rows[1]["active_experts"] > rows[0]["active_experts"] == moe_cpu.TOP_K
