"""GPTQ (Frantar et al., 2022): INT4 rounding that compensates each column's error on the
columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

Groups stay contiguous in the original column order (our packed layout has no g_idx):
with `act_order` columns are *visited* in decreasing Hessian-diagonal order but each column
keeps the scale of its own contiguous group, computed before the pass ("static groups").
"""

from __future__ import annotations

import torch

from app.quant.int4 import Int4Weight, check_grouping, group_params, pack_int4, quantize_codes


class HessianAccumulator:
    """H = 2/n * sum(x^T x) over calibration activations x: [..., K]."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.h = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        m = x.shape[0]
        self.h *= self.n / (self.n + m)
        self.n += m
        x = x * (2.0 / self.n) ** 0.5
        self.h += x.T @ x


def _inverse_hessian_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 after dampening the diagonal by damp * mean(diag)."""
    h = h.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(hinv, upper=True)


def quantize_gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int = 128,
    symmetric: bool = True,
    act_order: bool = False,
    damp: float = 0.01,
    block_size: int = 128,
    scale_dtype: torch.dtype | None = None,
) -> Int4Weight:
    """w: [N, K], hessian: [K, K] -> Int4Weight minimizing ||X W^T - X Q^T|| column by column."""
    n, k = w.shape
    scale_dtype = check_grouping(w, group_size, scale_dtype)
    w = w.float().clone()
    h = hessian.float().clone()
    dead = h.diagonal() == 0  # inputs that never fire: any value is as good as zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    groups = k // group_size
    scale = torch.empty(n, groups, device=w.device)
    zero = torch.empty(n, groups, device=w.device)
    if act_order:  # static groups, from the weights before any error feedback
        s, z = group_params(w.view(n, groups, group_size), symmetric, scale_dtype)
        scale.copy_(s)
        zero.copy_(z)
        perm = torch.argsort(h.diagonal(), descending=True)
    else:
        perm = torch.arange(k, device=w.device)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = _inverse_hessian_cholesky(h, damp)
    block_size = max(block_size // group_size, 1) * group_size  # a group never spans blocks

    q = torch.empty_like(w)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        wb, err = w[:, b0:b1].clone(), torch.empty(n, b1 - b0, device=w.device)
        for i in range(b1 - b0):
            col = int(perm[b0 + i])
            grp = col // group_size
            if not act_order and col % group_size == 0:  # group params from updated weights
                s, z = group_params(wb[:, i : i + group_size], symmetric, scale_dtype)
                scale[:, grp], zero[:, grp] = s, z
            qc = quantize_codes(wb[:, i : i + 1], scale[:, grp], zero[:, grp]).squeeze(1)
            deq = (qc - zero[:, grp]) * scale[:, grp]
            q[:, b0 + i] = qc
            e = (wb[:, i] - deq) / hinv[b0 + i, b0 + i]
            wb[:, i:] -= e.unsqueeze(1) * hinv[b0 + i, b0 + i : b1].unsqueeze(0)
            err[:, i] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]

    codes = torch.empty_like(q)
    codes[:, perm] = q
    zeros = None if symmetric else zero.to(torch.uint8)
    return Int4Weight(pack_int4(codes), scale.to(scale_dtype), zeros, group_size)
