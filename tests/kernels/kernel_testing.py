"""Shared builders for the kernel tests: a paged cache with non-trivial FP8 scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve_kernels import reference

FP8 = torch.float8_e4m3fn
# Per query dtype (atol, rtol) for attention outputs of magnitude ~1. fp16 rounds p and the
# dequantized K/V once (2**-11 relative); fp32 runs ieee dots.
ATTN_TOL = {torch.float16: (3e-3, 3e-3), torch.float32: (2e-5, 2e-5)}


@dataclass
class PagedCache:
    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, block_size, Hkv] int8
    v_scale: torch.Tensor | None

    def args(self) -> tuple:
        return self.k, self.v, self.k_scale, self.v_scale


def empty_cache(dtype, num_blocks: int, block_size: int, hkv: int, d: int) -> PagedCache:
    k = torch.zeros(num_blocks, block_size, hkv, d, dtype=dtype)
    ks = torch.zeros(num_blocks, block_size, hkv, dtype=torch.int8) if dtype == FP8 else None
    vs = ks.clone() if ks is not None else None
    return PagedCache(k, k.clone(), ks, vs)


def random_kv(t: int, hkv: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V whose per-token magnitude spans 2**-4..2**4, so FP8 exponents differ per token
    and are far from 0: a kernel that skips or misplaces a descale is off by >= 2x."""
    mag_k = torch.exp2(torch.randint(-4, 5, (t, hkv, 1), generator=gen).float())
    mag_v = torch.exp2(torch.randint(-4, 5, (t, hkv, 1), generator=gen).float())
    k = torch.randn(t, hkv, d, generator=gen) * mag_k
    v = torch.randn(t, hkv, d, generator=gen) * mag_v
    return k, v


def filled_cache(dtype, num_blocks, block_size, hkv, d, gen) -> PagedCache:
    """Every slot written through the reference kv_write (so FP8 values carry scales)."""
    cache = empty_cache(dtype, num_blocks, block_size, hkv, d)
    k, v = random_kv(num_blocks * block_size, hkv, d, gen)
    reference.kv_write(k, v, *cache.args(), torch.arange(num_blocks * block_size))
    if dtype == FP8:
        assert cache.k_scale.unique().numel() > 3 and (cache.k_scale != 0).all()
    return cache


def block_tables(lens: list[int], block_size: int, num_blocks: int, gen) -> torch.Tensor:
    """Disjoint, shuffled (non-contiguous) block ids per sequence -> [B, max_blocks] int32.

    Unused entries are -1 so a kernel that reads past a sequence's blocks faults or fails."""
    need = [(n + block_size - 1) // block_size for n in lens]
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(need) <= num_blocks
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    start = 0
    for b, nb in enumerate(need):
        table[b, :nb] = perm[start : start + nb]
        start += nb
    return table


# INT4 GEMMs: relative (to max |y|) error per activation dtype (fp16 rounds x and the
# dequantized W once)
INT4_REL_TOL = {torch.float16: 2e-3, torch.float32: 1e-5}


def int4_problem(m, n, k, group, symmetric, dtype, seed=0):
    """x [m, k] and a random canonical INT4 weight (qweight [n, k/8] int32, scales and, when
    asymmetric, zeros [n, k/group]): -> (x, qweight, scales, zeros, group)."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, k // group), generator=gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, qweight, scales, zeros, group
