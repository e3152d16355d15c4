"""W8A8 or W8A16 for an FP8 linear: the `fp8_activations` engine option and its `auto` rule.

- `w8a16`: activations stay bf16/fp16; the FP8 weight is dequantized inside the GEMM
  (`slimserve_kernels/fp8_gemm_triton.py`).
- `w8a8`: activations are quantized to FP8 per (token, 128-column group), then both operands
  go to the FP8 block GEMM (`slimserve_kernels/fp8_w8a8_triton.py`): FP8 tensor-core dots
  from compute capability 8.9; below it the kernel upcasts to fp16 (correct, not faster).
- `auto` (the default): W8A8 on GPUs with FP8 tensor cores (sm_89+) for weights of at least
  `W8A8_MIN_N` output columns, whatever the token count; W8A16 otherwise.

CPU keeps W8A16 whatever the option (each FP8 layer is dequantized for its forward; no FP8
activations): `use_w8a8` is asked only where the Triton kernels run.
"""

from __future__ import annotations

import torch

from slimserve_kernels.device import fp8_tensor_cores  # the kernels' own test (sm_89+)

# Measured (an H100, 2026-12-05, `python bench/kernels.py --quick`, model_gemm rows, W8A8 ms
# over W8A16 ms at the Llama-3-8B, GLM-4.5 and Kimi K2 projections; docs/quantization.md):
# W8A8 is faster at every token count measured (geometric means 1.10x / 1.11x / 1.11x /
# 1.19x / 2.66x / 1.27x at 1 / 8 / 32 / 256 / 1,024 / 4,096 tokens), and not only from the
# hundreds of tokens where FP8 tensor cores double the dense rate: its tiles also read the
# weight faster at decode sizes, and W8A16 from 1,024 tokens dequantizes the whole weight
# before cuBLAS. The exception is a narrow output: Kimi K2's kv_a (N = 576) is slower under
# W8A8 at every size (0.87-0.96x, and 0.42x at 4,096 tokens); the next narrowest (q_a,
# N = 1,536) is 0.95-1.58x. Hence no token threshold, and an N threshold between the two.
# Left slower under the rule: GLM-4.5's shared-expert down projection (K 1,536, N 5,120) at
# 1-32 tokens (0.86-0.91x), Kimi K2's q_b at 256 (0.80x). One run, one GPU: the rule is
# re-read from bench/kernels.py on each GPU a session is lent.
W8A8_MIN_N = 1024


def use_w8a8(mode: str, x: torch.Tensor, n: int) -> bool:
    """W8A8 for this GEMM? x: [M, K], the activations the Triton kernels would take; n: the
    weight's output columns on this device (a TP shard's own)."""
    if mode == "w8a8":
        return True
    if mode == "w8a16":
        return False
    assert mode == "auto", mode
    return n >= W8A8_MIN_N and fp8_tensor_cores(x.device)
