"""Tensor-parallel context: which rank this process is and how to talk to the others.

With `size == 1` (the default) every collective is a no-op, so single-process code pays
nothing for being tensor-parallel-ready. `expert_parallel` makes MoE layers partition their
routed experts across the same ranks instead of splitting each expert (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TPContext:
    rank: int = 0
    size: int = 1
    group: Any = None
    expert_parallel: bool = False

    def __post_init__(self):
        assert 0 <= self.rank < self.size, "rank must lie in [0, size)"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., n] per rank -> [..., n * size], rank-major along the last dim."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={self.size}")
        return n // self.size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds: a slice when total >= size, else one
        head replicated on size // total consecutive ranks."""
        if total >= self.size:
            n = self.split(total, "num_key_value_heads")
            return self.rank * n, n
        if self.size % total:
            raise ValueError(
                f"num_key_value_heads={total} must divide tensor_parallel_size={self.size}"
            )
        return self.rank // (self.size // total), 1

    def experts(self, total: int) -> range:
        """Routed experts this rank owns: all of them unless expert-parallel."""
        if not self.expert_parallel:
            return range(total)
        n = self.split(total, "n_routed_experts")
        return range(self.rank * n, (self.rank + 1) * n)


SINGLE = TPContext()
