"""One dispatch point per kernel: Triton on CUDA (when triton imports), the PyTorch
reference elsewhere.

`force_triton()` (or SLIMSERVE_FORCE_TRITON=1) sends CPU tensors to the Triton kernels too,
which then run under the interpreter (TRITON_INTERPRET=1 must be set before triton is
imported). The `triton_*` names always run Triton. Importing this package never imports
triton: the kernel modules load on first use. The Triton modules are named `*_triton`
(`slimserve_kernels/int4_gemm_triton.py`, ...) so that importing one never rebinds the dispatch
function of the same name on this package.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Iterator

import torch

from slimserve_kernels import reference

__all__ = [
    "force_triton",
    "fp8_gemm",
    "fused_moe",
    "int4_gemm",
    "int4_gemm_kn",
    "kv_write",
    "paged_decode_attention",
    "paged_prefill_attention",
    "triton_available",
    "triton_fp8_gemm",
    "triton_fp8_w8a8_gemm",
    "triton_fused_moe",
    "triton_int4_gemm",
    "triton_int4_gemm_kn",
    "triton_kv_write",
    "triton_paged_decode_attention",
    "triton_paged_prefill_attention",
    "use_triton",
]

_force = os.environ.get("SLIMSERVE_FORCE_TRITON", "") == "1"


@functools.cache
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def force_triton(enabled: bool = True) -> Iterator[None]:
    """Within the block, dispatch to Triton whatever the device (the interpreter on CPU)."""
    global _force
    previous, _force = _force, enabled
    try:
        yield
    finally:
        _force = previous


def use_triton(t: torch.Tensor) -> bool:
    return (_force or t.is_cuda) and triton_available()


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(f"slimserve_kernels.{module}"), name)


def triton_int4_gemm(*args, **kwargs) -> torch.Tensor:
    return _kernel("int4_gemm_triton", "int4_gemm")(*args, **kwargs)


def triton_int4_gemm_kn(*args, **kwargs) -> torch.Tensor:
    return _kernel("int4_kn_triton", "int4_gemm_kn")(*args, **kwargs)


def triton_fp8_gemm(*args, **kwargs) -> torch.Tensor:
    return _kernel("fp8_gemm_triton", "fp8_gemm")(*args, **kwargs)


def triton_fp8_w8a8_gemm(*args, **kwargs) -> torch.Tensor:
    """W8A8: x quantized per token group to FP8, then the FP8 block GEMM (fp8_w8a8_triton)."""
    return _kernel("fp8_w8a8_triton", "fp8_w8a8_gemm")(*args, **kwargs)


def triton_fused_moe(*args, **kwargs) -> torch.Tensor:
    return _kernel("fused_moe_triton", "fused_moe")(*args, **kwargs)


def triton_kv_write(*args, **kwargs) -> None:
    return _kernel("kv_write_triton", "kv_write")(*args, **kwargs)


def triton_paged_decode_attention(*args, **kwargs) -> torch.Tensor:
    return _kernel("paged_decode", "paged_decode_attention")(*args, **kwargs)


def triton_paged_prefill_attention(*args, **kwargs) -> torch.Tensor:
    return _kernel("paged_prefill", "paged_prefill_attention")(*args, **kwargs)


def int4_gemm(x, qweight, scales, zeros, group_size: int) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T, W from INT4 qweight [N, K // 8]; see README.md here."""
    fn = triton_int4_gemm if use_triton(x) else reference.int4_gemm
    return fn(x, qweight, scales, zeros, group_size)


def int4_gemm_kn(x, w) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T, W an `int4_layout.Int4KN` (the K-major layout the GEMV and
    split-K kernels read; made from the canonical one at load time); see README.md here."""
    if use_triton(x):
        return triton_int4_gemm_kn(x, w)
    from slimserve_kernels.int4_layout import int4_gemm_kn as reference_kn

    return reference_kn(x, w)


def fp8_gemm(x, weight, scale, block: tuple[int, int]) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T, W = FP8 weight [N, K] * block scale; see README.md here."""
    fn = triton_fp8_gemm if use_triton(x) else reference.fp8_gemm
    return fn(x, weight, scale, block)


def fused_moe(x, topk_weights, topk_ids, w) -> torch.Tensor:
    """Routed experts' weighted sum [T, H] for x [T, H] and its top-k (weights, local expert
    ids) [T, k], w a `slimserve_kernels.moe_common.MoEWeights`: Triton's two grouped GEMMs on CUDA,
    the sorted-layout torch path on CPU (reference.fused_moe is the per-expert loop)."""
    if use_triton(x):
        return triton_fused_moe(x, topk_weights, topk_ids, w)
    from slimserve_kernels.moe_common import fused_moe_torch

    return fused_moe_torch(x, topk_weights, topk_ids, w)


def kv_write(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Scatter (and FP8-quantize) K/V [T, Hkv, D] into the paged cache at slot_mapping [T]."""
    fn = triton_kv_write if use_triton(k) else reference.kv_write
    fn(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping)


def paged_decode_attention(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, sm_scale: float
) -> torch.Tensor:
    """q [B, Hq, D] against each sequence's paged context -> [B, Hq, D]."""
    fn = triton_paged_decode_attention if use_triton(q) else reference.paged_decode_attention
    return fn(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, sm_scale)


def paged_prefill_attention(
    q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens, sm_scale: float
) -> torch.Tensor:
    """Causal varlen attention of q [T, Hq, D] over the paged cache -> [T, Hq, D]."""
    use = use_triton(q)
    fn = triton_paged_prefill_attention if use else reference.paged_prefill_attention
    return fn(
        q, k_cache, v_cache, k_scale, v_scale, block_tables, query_start_loc, seq_lens, sm_scale
    )
