"""W8A8 or W8A16 for an FP8 linear: the `fp8_activations` engine option and its `auto` rule.

- `w8a16`: activations stay bf16/fp16; the FP8 weight is dequantized inside the GEMM
  (`slimserve_kernels/fp8_gemm_triton.py`).
- `w8a8`: activations are quantized to FP8 per (token, 128-column group), then both operands
  go to the FP8 block GEMM (`slimserve_kernels/fp8_w8a8_triton.py`): FP8 tensor-core dots
  from compute capability 8.9; below it the kernel upcasts to fp16 (correct, not faster).
- `auto` (the default): W8A8 on GPUs with FP8 tensor cores (sm_89+) for GEMMs of fewer than
  `DEQUANT_MIN_M` (1,024) rows whose weight has at least `W8A8_MIN_N` output columns; W8A16
  otherwise (from 1,024 rows: the weight dequantized once, then cuBLAS).

CPU keeps W8A16 whatever the option (each FP8 layer is dequantized for its forward; no FP8
activations): `use_w8a8` is asked only where the Triton kernels run.
"""

from __future__ import annotations

import torch

# fp8_tensor_cores: the kernels' own test (sm_89+); DEQUANT_MIN_M: W8A16's dequantize-once
# + cuBLAS from there
from slimserve_kernels.device import DEQUANT_MIN_M, fp8_tensor_cores

# Measured (an H100, 2026-12-05, `python bench/kernels.py --quick`, model_gemm rows, W8A8 ms
# over W8A16 ms at 15 projections of Llama-3-8B, GLM-4.5 and Kimi K2; docs/quantization.md).
# Below 1,024 rows both run tiled Triton kernels and W8A8 is faster by geometric mean at every
# size measured (1.10x / 1.11x / 1.11x / 1.19x at 1 / 8 / 32 / 256 tokens), not only where FP8
# tensor cores double the dense rate: its tiles also read the weight faster at decode sizes.
# The one projection slower at every size is the narrowest, Kimi K2's kv_a (N = 576: 0.67-
# 0.96x); the next narrowest, q_a (N = 1,536), is level (0.95-1.00x to 32 tokens, 1.08x at
# 256): hence a threshold on N. Left slower under the rule (N >= 1,024, M < 1,024), 11 of 56
# points: GLM-4.5's shared-expert down projection at 1-32 tokens (0.86-0.91x), Kimi K2's q_b
# at 256 (0.80x), and 0.95-1.00x for GLM-4.5 shared gate_up, Kimi K2 q_a / q_b / shared down
# and Llama-3-8B o at a few decode sizes.
# From 1,024 rows W8A8 measured 0.21-0.83x cuBLAS BF16, and W8A16 now dequantizes the weight
# in one Triton pass (3 bytes per weight) before cuBLAS, which its traffic puts at BF16's time
# plus ~10%: W8A16 there (the H100's W8A16 numbers at 1,024+ rows were of an older, PyTorch
# dequantization, 5x BF16; the new pass is not yet timed on a GPU). Measured at full
# single-GPU shapes; under TP the rule sees each shard's own N. One run, one GPU: re-read
# from bench/kernels.py on each GPU a session is lent.
W8A8_MIN_N = 1024


def use_w8a8(mode: str, x: torch.Tensor, n: int) -> bool:
    """W8A8 for this GEMM? x: [M, K], the activations the Triton kernels would take; n: the
    weight's output columns on this device (a TP shard's own)."""
    if mode == "w8a8":
        return True
    if mode == "w8a16":
        return False
    assert mode == "auto", mode
    return x.shape[0] < DEQUANT_MIN_M and n >= W8A8_MIN_N and fp8_tensor_cores(x.device)
