"""Pieces of the split-K GEMM kernels (fp8_gemm_triton.py, int4_gemm_triton.py): a program
owns one [BLOCK_M, BLOCK_N] output tile and one slice of K, and writes its partial product
to y[split] (the host sums the splits in fp32, or y is the output when there is one)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def output_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(offs_m [BM], offs_n [BN], split) of this program; grid: (M tiles, N tiles, splits)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.program_id(2)


@triton.jit
def split_k_range(split, k_per_split, K):
    """[k_lo, k_hi): the columns of K that split `split` covers."""
    k_lo = split * k_per_split
    return k_lo, tl.minimum(k_lo + k_per_split, K)


@triton.jit
def load_x_tile(x_ptr, rows, offs_m, offs_k, M, K, stride_xm):
    """x[offs_m, offs_k] -> [BM, BK], 0 outside x; rows: offs_m in int64."""
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    return tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def store_split(y_ptr, acc, rows, offs_m, offs_n, split, M, N, stride_ys, stride_ym):
    """acc [BM, BN] -> y[split, offs_m, offs_n] in y's dtype, inside y only; rows: offs_m as
    the address arithmetic takes them (int64 where a tile may lie past 2**31 elements)."""
    y_ptrs = y_ptr + split * stride_ys + rows[:, None] * stride_ym + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k(tiles: int, k_tiles: int, num_sms: int) -> int:
    """Splits of K for a tiled launch of `tiles` output tiles over `k_tiles` K tiles: enough
    programs for two per SM, at least 4 K tiles per split, at most 16 splits."""
    return max(1, min(triton.cdiv(2 * num_sms, tiles), k_tiles // 4, 16))


@triton.jit
def swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(offs_m [BM], offs_n [BN]) of program `pid` in a 1-D grid over the output tiles, walked
    in groups of GROUP_M tile rows (column by column inside a group), so programs running at
    once share W's column tiles and x's row tiles in L2."""
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
