"""What the launch heuristics need to know about the GPU."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU (132, an H100/H200, for CPU/interpreter runs)."""
    return _device_sms(t.device.index or 0) if t.is_cuda else 132
