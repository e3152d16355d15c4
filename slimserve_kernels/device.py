"""What the launch heuristics need to know about the GPU, and the thresholds they share."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# e4m3 in hardware (loads and conversions of float8e4nv, FP8 tensor-core dots): compute
# capability 8.9 (Ada) and up (Hopper).
FP8_CAPABILITY = (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` is a GPU with native e4m3 (FP8 tensor cores): CUDA, sm_89 or newer."""
    return device.type == "cuda" and _capability(device.index or 0) >= FP8_CAPABILITY


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU (132, an H100/H200, for CPU/interpreter runs)."""
    return _device_sms(t.device.index or 0) if t.is_cuda else 132


# From this M on, the weight-only GEMMs (int4_gemm_triton, fp8_gemm_triton) dequantize W once
# and call cuBLAS: the extra 2*N*K*2 bytes of traffic are <10% of a compute-bound GEMM's time
# at M >= 1024 on an H100-class GPU, and cuBLAS beats a fused-dequant Triton tile there. An
# estimate, not a measurement: bench/kernels.py times both paths ("tiled" and "dequant") so
# this threshold can be set from data. Here (no Triton import) because
# app/quant/fp8_activations.py's rule follows it too.
DEQUANT_MIN_M = 1024
