"""Tuned launch configs as checked-in data (no Triton import).

One JSON per (kernel family, GPU name): `slimserve_kernels/configs/<kernel>/<device>.json`,
written by the sweep that measured it (`bench/int4_gemv_sweep.py`, `bench/fp8_gemm_sweep.py`):

    {"kernel": "int4_kn", "device": "NVIDIA H100 80GB HBM3", "source": "bench/...",
     "key": ["m_bucket", "n", "k", "group"], "configs": {"1,28672,4096,128": {...}, ...}}

A kernel's `choose_config` asks `lookup(kernel, device, key)` first and falls back to its
fixed rule where the table has no entry (another GPU, an untuned shape, the CPU).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("configs")


def device_file_name(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3' (the table's file stem)."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_")


def device_name(t: torch.Tensor) -> str:
    """The GPU's name as torch reports it; 'cpu' off CUDA (no table: the fixed rule)."""
    return torch.cuda.get_device_name(t.device) if t.is_cuda else "cpu"


def m_bucket(m: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= m, or the largest bucket."""
    return next((b for b in buckets if m <= b), buckets[-1])


def table_path(kernel: str, device: str, root: Path | None = None) -> Path:
    return (root or CONFIG_DIR) / kernel / f"{device_file_name(device)}.json"


@functools.cache
def table(kernel: str, device: str) -> dict[str, dict]:
    """{key: config} for one kernel on one GPU; {} where none is checked in."""
    path = table_path(kernel, device)
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    assert data["kernel"] == kernel, (path, data["kernel"])
    return data["configs"]


def lookup(kernel: str, device: str, key: tuple) -> dict | None:
    """The tuned config for `key` (joined with ','), or None."""
    cfg = table(kernel, device).get(",".join(str(k) for k in key))
    return dict(cfg) if cfg is not None else None


def write_table(kernel: str, device: str, key_names: list[str], configs: dict, source: str,
                root: Path | None = None) -> Path:  # fmt: skip
    """Write (replace) one table; returns its path. Used by the sweeps."""
    path = table_path(kernel, device, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(kernel=kernel, device=device, source=source, key=key_names, configs=configs)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
