"""bench/kernels.py --cpu-smoke runs end to end and its interpreter results match the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton
pytest.importorskip("triton")
pytest.importorskip("matplotlib")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def test_cpu_smoke(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads((tmp_path / "kernels_smoke.json").read_text())
    assert (tmp_path / "kernels_smoke.png").stat().st_size > 10_000
    assert result["mode"] == "cpu-smoke"
    gemm = [r for r in result["rows"] if r["op"] == "gemm" and r["impl"] == "int4"]
    attn = [r for r in result["rows"] if r["op"] == "decode_attention"]
    assert {r["path"] for r in gemm} == {"gemv", "tiled"}
    assert len(attn) == 8 and {r["impl"] for r in attn} == {"fp8", "bf16"}
    assert all(r["rel_err"] < 2e-3 for r in gemm)  # fp16 activations
    assert all(r["max_abs_err"] < 1e-4 for r in attn)  # fp32 queries
    assert all(r["gbps"] > 0 for r in result["rows"])
    assert len(result["gemm_speedup"]) == 3 and len(result["attention_speedup"]) == 4
    # The model-shape sections (bench/kernels_models.py), at tiny shapes.
    assert (tmp_path / "kernels_smoke_models.png").stat().st_size > 10_000
    moe = [r for r in result["model_rows"] if r["op"] == "moe"]
    assert {(r["impl"], r["m"]) for r in moe} == {
        (k, m) for k in ("bf16", "fp8", "int4") for m in (1, 5)
    }
    assert all(r["rel_err"] < 2e-3 and r["ms"] > 0 and r["loop_ms"] > 0 for r in moe)
    gemm = [r for r in result["model_rows"] if r["op"] == "model_gemm"]
    assert {r["impl"] for r in gemm} == {"bf16", "fp8", "int4", "w8a8"}
    assert all(r["rel_err"] < 2e-3 for r in gemm if r["impl"] != "bf16")
    assert len(result["model_gemm_speedup"]) == 3 * len(gemm) // 4
    assert len(result["w8a8_vs_w8a16"]) == len(gemm) // 4
    table = result["seed_table"]
    assert [(r["phase"], r["tokens"]) for r in table] == [("decode", 1), ("prefill", 5)]
    assert all(r["int4_speedup_vs_fp8"] > 0 for r in table)


def test_fp8_gemm_sweep_smoke(tmp_path):
    """bench/fp8_gemm_sweep.py --smoke (the interpreter, a tiny grid holding the table's own
    config): every config runs and matches the reference, and the table's row is found, so
    the sweep's plumbing is known to work before a GPU's minutes are spent on it."""
    sweep = SCRIPT.parent / "fp8_gemm_sweep.py"
    tables = tmp_path / "tables"
    res = subprocess.run(
        [sys.executable, str(sweep), "--smoke", "--out", str(tmp_path), "--table-dir", str(tables)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    (point,) = json.loads((tmp_path / "fp8_gemm_sweep.json").read_text())["points"]
    assert len(point["rows"]) >= 2 and all(r["rel_err"] < 1e-2 for r in point["rows"])
    assert point["current_row"] is not None and point["best"] is not None
    table = json.loads((tables / "fp8_w8a8" / "cpu.json").read_text())
    assert list(table["configs"]) == ["64,96,256"] and table["key"] == ["m_bucket", "n", "k"]


def test_int4_gemv_sweep_smoke(tmp_path):
    """bench/int4_gemv_sweep.py --smoke: the K-major GEMV and split-K configs run under the
    interpreter against the reference, and the tuned table it writes is the one
    `int4_kn_triton.choose_config` reads (kernel, key, a config per swept point)."""
    sweep = SCRIPT.parent / "int4_gemv_sweep.py"
    tables = tmp_path / "tables"
    res = subprocess.run(
        [sys.executable, str(sweep), "--smoke", "--out", str(tmp_path), "--table-dir", str(tables)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    points = json.loads((tmp_path / "int4_gemv_sweep.json").read_text())["points"]
    assert [p["m"] for p in points] == [1, 8]
    assert all(r["rel_err"] < 2e-3 for p in points for r in p["rows"])
    table = json.loads((tables / "int4_kn" / "cpu.json").read_text())
    assert table["kernel"] == "int4_kn" and set(table["configs"]) == {"1,48,256,64", "8,48,256,64"}
    assert {c["path"] for c in table["configs"].values()} == {"gemv", "splitk"}
