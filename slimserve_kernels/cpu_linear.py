"""The C++ CPU float32 linear (`csrc/linear_cpu.cpp`), built just in time (`cpu_build.py`:
once per source and torch version, AVX-512 / AVX2 / baseline copies picked at run time).

`pack(W)` lays a weight [N, K] out once as panels [ceil(N / 32), K, 32] (32 output columns
contiguous per k, the tail zero-padded); `linear(x, packed, n, bias)` runs a register-blocked
micro-kernel (up to 8 rows x 32 columns of accumulators) over them, at any M, K, N.
Each output is one FMA chain over k in order, whatever M or the thread count: a row's result
does not depend on its batch (batch-invariant; aten's GEMM is not).

`available()` is False, logging why once, when the kernels are off (`SLIMSERVE_CPU_KERNELS=0`,
read on every call) or the build failed (no compiler, not x86-64); callers then keep
F.linear. The model's linears ask once, when their weights are packed
(app/models/layers.py `pack_cpu_linears`), not per call (~1 us of an env read each).
"""

from __future__ import annotations

import logging

import torch

from slimserve_kernels import cpu_build

log = logging.getLogger(__name__)

ENV = cpu_build.ENV
FALLBACK = "F.linear"
WHAT = "CPU linear"
# available(): on (SLIMSERVE_CPU_KERNELS) and built; load(): the extension (built at the
# first call), or None where it does not build (logged once)
available, load = cpu_build.loader("linear_cpu", WHAT, FALLBACK, log)
PANEL = 32  # output columns per panel (kPanel in the source)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 (any strides) -> panels [ceil(N / 32), K, 32], tail zero-padded.
    Call only when `available()`."""
    return load().pack(weight)


def linear(
    x: torch.Tensor,  # [..., K] float32
    packed: torch.Tensor,  # [ceil(N / 32), K, 32] from pack(), or W [N, K] column-major
    n: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """-> [..., N] = x W^T (+ bias), x of any strides. Call only when `available()`."""
    return load().linear(x, packed, n, bias)
