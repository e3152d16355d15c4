"""Lazy checkpoint tensors: each rank reads only its slice of a safetensors tensor.

`LazyTensor` wraps `safe_open(...).get_slice(name)`. Weight loaders narrow it exactly as they
narrow a tensor (`narrow`, `t[a:b]`, `.shape`); only the final copy reads bytes, and only the
rows/columns of this rank's shard. Any torch function given a LazyTensor reads it first
(`__torch_function__`), so loaders that were written for tensors keep working.
"""

from __future__ import annotations

from typing import Any

import torch


class LazyTensor:
    def __init__(self, source: Any, shape: tuple[int, ...], ranges=None, dtype=None):
        self.source = source  # a safetensors PySafeSlice (or any object indexable by slices)
        self.full_shape = tuple(shape)
        self.ranges = ranges or tuple((0, n) for n in shape)  # [start, stop) per dim
        self.cast = dtype  # applied after reading

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self.ranges)

    def dim(self) -> int:
        return len(self.ranges)

    def size(self, d: int | None = None):
        return self.shape if d is None else self.shape[d]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        a, b = self.ranges[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise ValueError(f"narrow({dim}, {start}, {length}) outside shape {tuple(self.shape)}")
        ranges = list(self.ranges)
        ranges[dim] = (a + start, a + start + length)
        return LazyTensor(self.source, self.full_shape, tuple(ranges), self.cast)

    def __getitem__(self, key) -> LazyTensor:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("LazyTensor supports only t[a:b] on the first dim")
        start, stop, _ = key.indices(self.shape[0])
        return self.narrow(0, start, max(0, stop - start))

    def to(self, *args, **kwargs):
        """to(dtype) stays lazy (the cast happens on read); anything else reads now."""
        if len(args) == 1 and not kwargs and isinstance(args[0], torch.dtype):
            return LazyTensor(self.source, self.full_shape, self.ranges, args[0])
        return self.materialize().to(*args, **kwargs)

    def materialize(self) -> torch.Tensor:
        t = self.source[tuple(slice(a, b) for a, b in self.ranges)]
        return t if self.cast is None else t.to(self.cast)

    def float(self) -> torch.Tensor:
        return self.materialize().float()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return func(*_read(args), **{k: _read(v) for k, v in (kwargs or {}).items()})


def _read(x):
    if isinstance(x, LazyTensor):
        return x.materialize()
    if isinstance(x, (list, tuple)):
        return type(x)(_read(v) for v in x)
    return x


def materialize(x) -> torch.Tensor:
    """A tensor from a tensor or a LazyTensor."""
    return x.materialize() if isinstance(x, LazyTensor) else x
