"""Exact e4m3 helpers shared by the Triton kernels (pure integer bit manipulation).

Why not `x.to(tl.float8e4nv)`: the interpreter's fp32 -> fp8 downcast does not round to
nearest-even, so the CPU tests could not compare bits with the reference. These helpers are
exact on every backend and cost a few integer ops per element (kv_write is memory-bound).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pow2(e):
    """2**e as fp32, exact, for integer e in [-126, 127] (built from the exponent bits)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp8_scale_exponent(amax):
    """e = ceil(log2(amax / 448)) clamped to [-100, 127], exactly as the reference computes it.

    amax = m * 2**E with m in [1, 2); 448 = 1.75 * 2**8, so e = E - 8 if m <= 1.75 else E - 7.
    """
    bits = amax.to(tl.int32, bitcast=True)
    big_e = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    e = tl.where(mant > 0x600000, big_e - 7, big_e - 8)
    return tl.minimum(tl.maximum(e, -100), 127)


@triton.jit
def fp32_to_e4m3_bits(x):
    """Round-to-nearest-even fp32 -> e4m3fn bits (uint8) for |x| <= 448."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(x)
    abits = a.to(tl.int32, bitcast=True)
    # Normal range (a >= 2**-6): round the fp32 mantissa to 3 bits, then rebias 127 -> 7.
    lsb = (abits >> 20) & 1
    normal = ((abits + 0x7FFFF + lsb) >> 20) - (120 << 3)
    # Subnormal range: a = n * 2**-9 with n in 0..8 (n == 8 is code 8, the smallest normal).
    y = a * 512.0
    fl = tl.floor(y)
    frac = y - fl
    odd = (fl.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    sub = fl.to(tl.int32) + up.to(tl.int32)
    mag = tl.where(a < 0.015625, sub, normal)
    return (mag | sign).to(tl.uint8)


@triton.jit
def e4m3_bits_to_fp16(b):
    """e4m3fn bits (uint8) -> fp16, exact: move exponent+mantissa into fp16's fields (bias 15
    instead of 7) and multiply by 2**8; e4m3 subnormals land exactly too. 0x7F (NaN) -> 480."""
    b = b.to(tl.int16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    return h.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def fp32_to_bf16_rne(x):
    """Round-to-nearest-even fp32 -> bf16 on integer bits. A GPU's cast already rounds so; the
    interpreter's truncates, and the CPU tests compare bits with torch. NaN goes through the
    cast (its bits + 0x7FFF could carry into the sign: 0x7FFFFFFF, a GPU's NaN, became -0)."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, x.to(tl.bfloat16), b.to(tl.uint16).to(tl.bfloat16, bitcast=True))
