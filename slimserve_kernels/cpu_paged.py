"""The C++ CPU paged attention and KV write (`csrc/paged_attention_cpu.cpp`), built just in
time (`cpu_build.py`: once per source and torch version, AVX-512 / AVX2 / baseline copies
picked at run time).

`paged_attention_cpu` reads the paged KV cache in place through the block table: no gather
copy of every sequence's blocks per layer, FP8 codes decoded in the kernel.

`available()` is False, logging why once, when the kernels are off (`SLIMSERVE_CPU_KERNELS=0`,
read on every call so a test can switch it) or the build failed (no compiler, not x86-64);
callers then keep the PyTorch path.
"""

from __future__ import annotations

import logging

import torch

from slimserve_kernels import cpu_build

log = logging.getLogger(__name__)

ENV = cpu_build.ENV
FALLBACK = "the torch path"
WHAT = "CPU paged attention"
# available(): on (SLIMSERVE_CPU_KERNELS) and built; load(): the extension (built at the
# first call), or None where it does not build (logged once)
available, load = cpu_build.loader("paged_attention_cpu", WHAT, FALLBACK, log)


def paged_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8 (FP8 cache only)
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, cached + new tokens
    query_start_loc: torch.Tensor | None,  # [B + 1] int32; None: one row per sequence
    sm_scale: float,
) -> torch.Tensor:
    """-> [T, Hq, D] float32. Query row j of a sequence with n new rows sits at position
    len - n + j and sees keys up to it. Call only when `available()`."""
    return load().paged_attention(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
        query_start_loc, sm_scale,
    )  # fmt: skip


def kv_write_cpu(
    k: torch.Tensor,  # [T, Hkv, D] float32
    v: torch.Tensor,
    k_cache: torch.Tensor,  # float32 or float8_e4m3fn [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8 (FP8 cache only)
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,  # [T] int64, contiguous; < 0 = skip
) -> None:
    """reference.kv_write, bit for bit, in one call (FP8: ~20 torch ops per layer before).
    Call only when `available()`."""
    load().kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)
