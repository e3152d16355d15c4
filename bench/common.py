"""Shared helpers for the benchmarks: model choice, result files, plots."""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import tempfile
import time
import urllib.request

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# One sample of Prometheus' text format: name{labels} value
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def default_model() -> str:
    """The embedded default model if it is there, else a tiny random Llama (head_dim 64)."""
    from app.assets import default_model_path

    path = default_model_path()
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    sys.path.insert(0, os.path.join(os.path.dirname(RESULTS), "..", "tests"))
    from tiny_models import make_checkpoint

    return make_checkpoint("llama", tempfile.mkdtemp(), head_dim=64, hidden_size=256)


def write_json(name: str, data: dict, out_dir: str = RESULTS) -> str:
    os.makedirs(out_dir, exist_ok=True)
    import torch

    data = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "time": time.time(),
        **data,
    }
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path


def bar_plot(
    name: str, title: str, groups: dict[str, dict[str, float]], ylabel: str, out_dir=RESULTS
):
    """groups: series -> {x label: value}; one PNG beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(next(iter(groups.values())))
    width = 0.8 / len(groups)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (series, values) in enumerate(groups.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [values[k] for k in labels], width, label=series)
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def kernel_timer(device: str, warmup: int, rep: int, scale: float = 1e3):
    """A callable that times one kernel call: Triton's `do_bench` on CUDA (it flushes L2
    before every call), one wall-clock call elsewhere (the CPU smoke runs). In ms x
    ``scale`` (1e3: microseconds)."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=warmup, rep=rep)) * scale

    def once(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3 * scale

    return once


def scrape_slimserve(port: int) -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every ``ray_slimserve_*`` sample on Ray's metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m["name"].startswith("ray_slimserve_"):
            out.append((m["name"], dict(_LABEL.findall(m["labels"] or "")), float(m["value"])))
    return out
