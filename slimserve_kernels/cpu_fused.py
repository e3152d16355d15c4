"""The C++ CPU fused elementwise ops of the decoder's float32 forward (`csrc/fused_cpu.cpp`),
built just in time (`cpu_build.py`: once per source and torch version, AVX-512 / AVX2 /
baseline copies picked at run time).

- `rms_norm(x, w, eps)` and `add_rms_norm(x, residual, w, eps)` (residual += x in place,
  then the norm of residual): `F.rms_norm`'s float32 result bit for bit.
- `silu_and_mul(gate_up)`: `F.silu(gate) * up` of the merged gate/up projection, bit for bit
  on this torch (SLEEF's expf, as torch's silu).
- `rotary_(x, positions, cos, sin)`: rotate-half RoPE in place, `RotaryEmbedding.rotate`'s
  result bit for bit.

Each replaces 3-8 torch ops (a dispatch, an allocation and a memory pass each) with one call.
Bitwise equality rests on ATen's reduction order and vector widths (`SUM_LANES`, `vec_lanes()`).

`takes(*tensors)` is False (callers keep the torch path) for anything but float32 CPU
tensors, when the kernels are off (`SLIMSERVE_CPU_KERNELS=0`, read on every call so a test
can switch it) or when the build failed (no compiler, not x86-64; logged once).
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from slimserve_kernels import cpu_build

log = logging.getLogger(__name__)

ENV = cpu_build.ENV
FALLBACK = "the torch path"
WHAT = "CPU fused ops"
# available(): on (SLIMSERVE_CPU_KERNELS) and built; load(): the extension (built at the
# first call), or None where it does not build (logged once)
available, load = cpu_build.loader("fused_cpu", WHAT, FALLBACK, log)


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the C++ ops take these tensors: all float32 on the CPU, and `available()`."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu:  # is_cpu: no device object per call
            return False
    return available()


def isa() -> str:
    """The instruction set the kernels run with here ("avx512", "avx2", "baseline")."""
    return load().isa()


# Floats per vector of ATen's sum kernel here: 8 on x86 even where torch runs AVX512 kernels
# (the sum is dispatched at most to its AVX2 copy; DEFAULT vectors are 8 wide too). The norm
# sums a row in that kernel's order to give F.rms_norm's bits (the bitwise test checks it).
SUM_LANES = 8


@cache
def vec_lanes() -> int:
    """Floats per vector of torch's own elementwise CPU kernels (16 under AVX512, else 8):
    which elements its silu takes in SLEEF's vector expf and which in the scalar expf."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] or [T, B, H] (H contiguous), w [H] -> F.rms_norm(x, (H,), w, eps), contiguous.
    Call only when `takes(x, w)`."""
    return load().rms_norm(x, w, eps, SUM_LANES)


def add_rms_norm(
    x: torch.Tensor,  # [T, H], H contiguous
    residual: torch.Tensor,  # [T, H] contiguous: += x in place
    w: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:
    """residual += x (in place), -> F.rms_norm(residual, (H,), w, eps). Call only when
    `takes(x, residual, w)`."""
    return load().add_rms_norm(x, residual, w, eps, SUM_LANES)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (last dim contiguous) -> F.silu(gate) * up [T, I], contiguous.
    Call only when `takes(gate_up)`."""
    return load().silu_and_mul(gate_up, vec_lanes())


def rotary_(
    x: torch.Tensor,  # [T, H, D] float32, D contiguous (any T / H strides): rotated in place
    positions: torch.Tensor,  # [T] int64, contiguous
    cos: torch.Tensor,  # [P, D] float32 (both halves, as RotaryEmbedding's tables)
    sin: torch.Tensor,
) -> None:
    """x <- x * cos[pos] + rotate_half(x) * sin[pos], in place. Call only when `takes(x)`."""
    load().rotary_(x, positions, cos, sin)
