"""bench/gpu_roofline.py --smoke: the issue-35 comparison harness end to end on CPU (tiny shapes,
the interpreter), so the GPU stage's plumbing is known to work before a GPU's minutes go to it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton
pytest.importorskip("triton")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_roofline.py"
FIELDS = {"kernel", "shape", "m_or_ctx", "device", "ours_us", "ratio", "pct_of_hbm", "rel_err"}


def test_smoke(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    rows = json.loads((tmp_path / "gpu_roofline.json").read_text())["rows"]
    assert (tmp_path / "gpu_roofline.png").stat().st_size > 10_000
    kernels = [r["kernel"] for r in rows]
    assert kernels.count("int4_w4a16") == 2 and kernels.count("fp8_w8a8") == 2
    assert kernels.count("decode_attention_fp8") == kernels.count("decode_attention_bf16") == 1
    for r in rows:
        assert set(r) >= FIELDS and r["device"] == "cpu" and r["ours_us"] > 0, r
        assert r["rel_err"] < 1e-5, r  # fp32 activations / queries
        contender = r.get("cublas_bf16_us") or r.get("bf16_cache_us")
        assert contender > 0 and r["ratio"] == pytest.approx(contender / r["ours_us"])
    int4 = [r for r in rows if r["kernel"] == "int4_w4a16"]
    assert all("gemlite_us" in r and r["gemlite_us"] is None for r in int4)  # no GPU here
