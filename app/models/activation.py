"""SwiGLU's activation of a merged gate/up projection: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slimserve_kernels import cpu_fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate columns first) -> silu(gate) * up [T, I].

    Float32 on the CPU: one C++ call (`cpu_fused.silu_and_mul`, same bits) instead of a
    chunk, a silu and a mul; elsewhere the torch expression."""
    if gate_up.dim() == 2 and gate_up.stride(-1) == 1 and cpu_fused.takes(gate_up):
        return cpu_fused.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
