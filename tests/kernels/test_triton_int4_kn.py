"""W4A16 on the K-major layout (int4_kn_triton: GEMV, split-K GEMM, dequant) vs the canonical
reference.int4_gemm, which stays the truth; the layout's own reference (int4_layout) too."""

from __future__ import annotations

import json

import pytest
import torch
from kernel_testing import INT4_REL_TOL, int4_problem

from slimserve_kernels import reference, tuned
from slimserve_kernels.int4_layout import Int4KN, column_major, dequantize_kn, int4_gemm_kn

pytestmark = pytest.mark.triton
kn = pytest.importorskip("slimserve_kernels.int4_kn_triton")


def _problem(m, n, k, group, symmetric, dtype, seed=0):
    """x and the canonical weight as one (qweight, scales, zeros, group) tuple."""
    x, *canonical = int4_problem(m, n, k, group, symmetric, dtype, seed)
    return x, tuple(canonical)


def _check(x, canonical, config=None):
    out = kn.int4_gemm_kn(x, Int4KN.of(*canonical), config=config)
    ref = reference.int4_gemm(x, *canonical)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < INT4_REL_TOL[x.dtype], err


@pytest.mark.parametrize("symmetric", [True, False])
def test_layout_reference_matches_canonical(symmetric):
    x, canonical = _problem(3, 24, 256, 64, symmetric, torch.float32)
    w = Int4KN.of(*canonical)
    assert w.shape == (24, 256) and (w.zs_t is None) == symmetric
    torch.testing.assert_close(int4_gemm_kn(x, w), reference.int4_gemm(x, *canonical))
    qw, s, z, g = canonical
    dense = reference.int4_gemm(torch.eye(256), qw, s, z, g)  # [K, N] = W.T
    torch.testing.assert_close(dequantize_kn(w), dense)


def test_column_major_words_need_no_copy():
    _, (qw, s, z, g) = _problem(1, 24, 128, 32, False, torch.float16)
    qw_cm, s_cm = column_major(qw), column_major(s)
    assert torch.equal(qw_cm, qw) and column_major(qw_cm).data_ptr() == qw_cm.data_ptr()
    w = Int4KN.of(qw_cm, s_cm, z, g)
    assert w.qweight_t.data_ptr() == qw_cm.data_ptr() and w.scales_t.data_ptr() == s_cm.data_ptr()


@pytest.mark.parametrize("m", [1, 3, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_default_config(m, dtype):
    # N = 40 is not a multiple of the N tiles; group 128 -> one scale load per GEMV program.
    x, canonical = _problem(m, 40, 384, 128, m % 2 == 1, dtype, seed=m)
    _check(x, canonical)


FORCED = [
    # (group, K, M, config): every scale mode of the GEMV, one K program (no atomics), the
    # split-K GEMM with and without splits over a swizzled grid (3 x 3 tiles, GROUP_M 2).
    (32, 224, 1, dict(path="gemv", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, CHUNKS=1)),  # per word
    (32, 224, 2, dict(path="gemv", BLOCK_M=2, BLOCK_N=32, BLOCK_K=32, CHUNKS=2)),  # per chunk
    (128, 384, 4, dict(path="gemv", BLOCK_M=4, BLOCK_N=16, BLOCK_K=32, CHUNKS=4)),  # per slice
    (32, 96, 3, dict(path="gemv", BLOCK_M=4, BLOCK_N=64, BLOCK_K=32, CHUNKS=4)),  # one slice
    (64, 192, 37, dict(path="splitk", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, split_k=3, GROUP_M=2)),
    (32, 224, 37, dict(path="splitk", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, split_k=1, GROUP_M=2)),
    (32, 96, 5, dict(path="dequant")),
]


@pytest.mark.parametrize("group,k,m,config", FORCED, ids=lambda v: str(v))
@pytest.mark.parametrize("symmetric", [True, False])
def test_forced_paths(group, k, m, config, symmetric):
    x, canonical = _problem(m, 40, k, group, symmetric, torch.float16, seed=k + m)
    _check(x, canonical, config)


def test_choose_config_rule_and_table(tmp_path, monkeypatch):
    cfg = kn.choose_config(1, 28672, 4096, 128)
    assert cfg["path"] == "gemv" and cfg["BLOCK_K"] * cfg["CHUNKS"] == 128  # one scale load
    assert kn.choose_config(4, 4096, 4096, 32)["BLOCK_M"] == 4
    assert kn.choose_config(16, 4096, 14336, 128)["split_k"] > 1  # 64 tiles: split K
    assert kn.choose_config(512, 28672, 4096, 128)["split_k"] == 1
    assert kn.choose_config(4096, 4096, 4096, 128)["path"] == "dequant"
    assert kn.table_key(20, 4096, 4096, 128) == (32, 4096, 4096, 128)
    # A checked-in table wins over the rule for its GPU only.
    mine = dict(path="gemv", BLOCK_M=1, BLOCK_N=256, BLOCK_K=128, CHUNKS=1, num_warps=8)
    tuned.write_table(kn.TABLE, "Test GPU 80GB", ["m", "n", "k", "group"],
                      {"1,4096,4096,128": mine}, "test", root=tmp_path)  # fmt: skip
    monkeypatch.setattr(tuned, "CONFIG_DIR", tmp_path)
    tuned.table.cache_clear()
    try:
        assert kn.choose_config(1, 4096, 4096, 128, "Test GPU 80GB") == mine
        assert kn.choose_config(1, 4096, 4096, 128, "Other GPU") != mine
        assert kn.choose_config(2, 4096, 4096, 128, "Test GPU 80GB") != mine
        path = tmp_path / kn.TABLE / "Test_GPU_80GB.json"
        assert json.loads(path.read_text())["key"] == ["m", "n", "k", "group"]
    finally:
        tuned.table.cache_clear()


def test_checked_in_tables_load():
    """Every checked-in table is valid JSON for its kernel and its configs run the wrapper's
    asserts' vocabulary (path and tiles)."""
    for path in sorted(tuned.CONFIG_DIR.glob("*/*.json")):
        data = json.loads(path.read_text())
        assert data["kernel"] == path.parent.name and data["configs"], path
        for cfg in data["configs"].values():
            assert "BLOCK_K" in cfg, (path, cfg)
