"""W8A8 or W8A16 for an FP8 linear: the `fp8_activations` engine option and its `auto` rule.

- `w8a16`: activations stay bf16/fp16; the FP8 weight is dequantized inside the GEMM
  (`slimserve_kernels/fp8_gemm_triton.py`).
- `w8a8`: activations are quantized to FP8 per (token, 128-column group), then both operands
  go to the FP8 block GEMM (`slimserve_kernels/fp8_w8a8_triton.py`): FP8 tensor-core dots
  from compute capability 8.9; below it the kernel upcasts to fp16 (correct, not faster).
- `auto`: W8A8 on GPUs with FP8 tensor cores for GEMMs of at least `W8A8_MIN_TOKENS` rows.

CPU keeps W8A16 whatever the option (each FP8 layer is dequantized for its forward; no FP8
activations): `use_w8a8` is asked only where the Triton kernels run.
"""

from __future__ import annotations

import torch

from slimserve_kernels.device import fp8_tensor_cores  # the kernels' own test (sm_89+)

# UNMEASURED: chosen from first principles, to be set by bench/kernels.py's `model_gemm` rows
# (impl "w8a8" vs "fp8", i.e. W8A8 vs W8A16, per model projection and M; docs/quantization.md).
# Below ~100 tokens an FP8-weight GEMM on an H100/H200 is bound by reading the weight (2M
# flops per weight byte against a ridge of ~200 for BF16 tensor cores at 3.35-4.8 TB/s), so
# FP8 tensor cores, which double only the dense throughput, cannot help, while quantizing
# the activations costs an extra pass over them and a launch. From a few hundred tokens the
# W8A16 GEMM is compute-bound at the BF16 rate and W8A8 can be up to 2x faster. 128 is also
# the first M whose tiles (BLOCK_M 128) run FP8 wgmma on Hopper (smaller tiles go through
# mma.sync, which Triton upcasts to fp16 on sm_90: tests/kernels/test_triton_gpu_compile.py).
W8A8_MIN_TOKENS = 128


def use_w8a8(mode: str, x: torch.Tensor) -> bool:
    """W8A8 for this GEMM? x: [M, K], the activations the Triton kernels would take."""
    if mode == "w8a8":
        return True
    if mode == "w8a16":
        return False
    assert mode == "auto", mode
    return x.shape[0] >= W8A8_MIN_TOKENS and fp8_tensor_cores(x.device)
