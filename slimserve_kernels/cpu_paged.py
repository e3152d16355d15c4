"""The C++ CPU paged attention and KV write (`csrc/paged_attention_cpu.cpp`), built just in
time.

`paged_attention_cpu` reads the paged KV cache in place through the block table: no gather
copy of every sequence's blocks per layer, FP8 codes decoded in the kernel. It is built once
per torch version and source with `torch.utils.cpp_extension.load` into torch's extensions
directory (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions); torch's file lock
there serializes concurrent first builds (several processes or Ray replicas). The build
takes no -march flag: the kernel's hot function is compiled for AVX-512, AVX2 and baseline
x86-64 (target attributes) and picked at the first call from the CPU's features, so a cached
build runs on any x86-64 CPU.

`available()` is False, logging why once, when the kernels are off (`SLIMSERVE_CPU_KERNELS=0`,
read on every call so a test can switch it) or the build failed (no compiler, not x86-64);
callers then keep the PyTorch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import cache
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_attention_cpu.cpp")
ENV = "SLIMSERVE_CPU_KERNELS"


def enabled() -> bool:
    """False when SLIMSERVE_CPU_KERNELS is 0 / false / off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def available() -> bool:
    """Whether paged_attention_cpu can run: on, and built (the first call builds)."""
    if not enabled():
        _log_off()
        return False
    return load() is not None


@cache
def _log_off() -> None:
    log.info("CPU paged attention: the C++ kernel is off (%s=0); using the torch path", ENV)


@cache
def load() -> ModuleType | None:
    """The compiled extension, or None (logged once) if it does not build here."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info(
            "CPU paged attention: no C++ kernel for %s; using the torch path", platform.machine()
        )
        return None
    try:
        return _build()
    except Exception as e:  # no compiler, a failed build: the torch path still works
        log.warning("CPU paged attention: C++ kernel build failed (%s); using the torch path", e)
        return None


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    with open(SOURCE, "rb") as f:  # the name keys the cache: a changed source or torch rebuilds
        digest = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
    # A first build takes ~40 s of one core (three instruction-set copies); say so, or the
    # first decode step looks hung. A cached build loads in well under a second.
    log.info("CPU paged attention: loading the C++ kernel (a first build takes ~40 s, once)")
    module = cpp_extension.load(
        name=f"slimserve_paged_attention_cpu_{digest}",
        sources=[SOURCE],
        extra_cflags=["-O3"],
        verbose=False,
    )
    log.info("CPU paged attention: C++ kernel loaded, %s (%s)", module.isa(), module.__file__)
    return module


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
