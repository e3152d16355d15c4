"""Triton W4A16 GEMM (GEMV, tiled, dequant paths) vs reference.int4_gemm."""

from __future__ import annotations

import pytest
import torch
from kernel_testing import INT4_REL_TOL, int4_problem

from slimserve_kernels import reference

pytestmark = pytest.mark.triton
gemm = pytest.importorskip("slimserve_kernels.int4_gemm_triton")


def _check(args, config=None):
    out = gemm.int4_gemm(*args, config=config)
    ref = reference.int4_gemm(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert err < INT4_REL_TOL[args[0].dtype], err


@pytest.mark.parametrize("m", [1, 3, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
def test_default_config(m, dtype, symmetric):
    # K = 160 is not a multiple of any K tile (64/128); N = 40 not a multiple of N tiles.
    _check(int4_problem(m, 40, 160, 32, symmetric, dtype))


@pytest.mark.parametrize("group,k", [(32, 96), (64, 192), (128, 384)])
def test_groups(group, k):
    _check(int4_problem(5, 24, k, group, False, torch.float32, seed=group))


SPLIT_CONFIGS = [
    dict(path="gemv", BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, split_k=3),
    dict(path="gemv", BLOCK_M=4, BLOCK_N=32, BLOCK_K=32, split_k=4),
    dict(path="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, split_k=3),
    dict(path="tiled", BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, split_k=1),
    dict(path="dequant", split_k=1),
]


@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=lambda c: f"{c['path']}-s{c['split_k']}")
@pytest.mark.parametrize("symmetric", [True, False])
def test_forced_paths(config, symmetric):
    m = config.get("BLOCK_M", 5) if config["path"] == "gemv" else 37
    _check(int4_problem(m, 40, 224, 32, symmetric, torch.float16, seed=m), config)


def test_choose_config():
    assert gemm.choose_config(1, 14336, 4096)["path"] == "gemv"
    assert gemm.choose_config(1, 14336, 4096)["split_k"] > 1  # 224 N-tiles < 2 per SM
    assert gemm.choose_config(64, 4096, 4096)["path"] == "tiled"
    assert gemm.choose_config(512, 14336, 4096)["split_k"] == 1  # 448 tiles fill the GPU
    assert gemm.choose_config(256, 4096, 14336)["split_k"] > 1  # 64 tiles do not
    assert gemm.choose_config(4096, 4096, 4096)["path"] == "dequant"


def test_float_zero_points():
    x, qw, s, z, g = int4_problem(5, 40, 160, 32, False, torch.float32)
    _check((x, qw, s, z.float() + 0.5, g))
