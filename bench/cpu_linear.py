"""The C++ CPU float32 linear (slimserve_kernels/cpu_linear.py) against aten (F.linear over
the column-major weight the engine stores) at the default model's GEMM shapes, one torch
thread by default.

Shapes (K -> N): qkv 256->512, o 256->256, gate_up 256->1536, down 768->256, lm_head
256->4096; M = 1, 8, 32, 64, 512 rows. Per (shape, M): the median of `--iters` calls after
a warm-up, for aten, the kernel over packed panels and the kernel over the column-major
weight in place; per M, one decode step's 17 GEMMs (4 layers + lm_head) as the sum of the
hot per-shape medians and timed over 17 distinct weights (streamed from L3, as in situ).

    flock /tmp/slimserve-bench.lock python bench/cpu_linear.py [--threads 1] [--out NAME]

Writes bench/results/<NAME>.json (default cpu_linear).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_json  # noqa: E402

SHAPES = {"qkv": (256, 512), "o": (256, 256), "gate_up": (256, 1536), "down": (768, 256),
          "lm_head": (256, 4096)}  # fmt: skip
PER_STEP = {"qkv": 4, "o": 4, "gate_up": 4, "down": 4, "lm_head": 1}  # GEMMs per decode step


def median_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def measure(m: int, k: int, n: int, iters: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    from slimserve_kernels import cpu_linear

    w = torch.randn(n, k).t().contiguous().t()  # column-major, as column_major_linears stores
    x = torch.randn(m, k)
    packed = cpu_linear.pack(w)
    out = {
        "aten_us": median_us(lambda: F.linear(x, w), iters),
        "packed_us": median_us(lambda: cpu_linear.linear(x, packed, n), iters),
        "colmajor_us": median_us(lambda: cpu_linear.linear(x, w, n), iters),
    }
    for key in ("aten", "packed", "colmajor"):
        out[f"{key}_gflops"] = 2 * m * k * n / out[f"{key}_us"] / 1e3
    return out


def step_us(m: int, iters: int) -> dict[str, float]:
    """One decode step's 17 GEMMs over distinct weights (4 layers + lm_head, 16.8 MB, more
    than L2): the weights stream from L3 as in the engine, unlike a hot single-shape loop."""
    import torch
    import torch.nn.functional as F

    from slimserve_kernels import cpu_linear

    gemms = []
    for name, count in PER_STEP.items():
        k, n = SHAPES[name]
        for _ in range(count):
            w = torch.randn(n, k).t().contiguous().t()
            gemms.append((torch.randn(m, k), w, cpu_linear.pack(w), n))
    return {
        "aten_us": median_us(lambda: [F.linear(x, w) for x, w, _, _ in gemms], iters),
        "packed_us": median_us(
            lambda: [cpu_linear.linear(x, pk, n) for x, _, pk, n in gemms], iters
        ),
        "colmajor_us": median_us(
            lambda: [cpu_linear.linear(x, w, n) for x, w, _, n in gemms], iters
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", default="cpu_linear")
    args = ap.parse_args()
    import torch

    from slimserve_kernels import cpu_linear

    torch.set_num_threads(args.threads)
    assert cpu_linear.available(), "the C++ kernel did not build"
    results, steps = [], {}
    for m in [int(r) for r in args.rows.split(",")]:
        step = dict.fromkeys(("aten_us", "packed_us", "colmajor_us"), 0.0)
        for name, (k, n) in SHAPES.items():
            r = {"m": m, "shape": name, "k": k, "n": n, **measure(m, k, n, args.iters)}
            results.append(r)
            for key in step:
                step[key] += r[key] * PER_STEP[name]
            print(f"M={m:4d} {name:8s} {k}->{n}: aten {r['aten_us']:8.1f} us "
                  f"packed {r['packed_us']:8.1f} colmajor {r['colmajor_us']:8.1f} "
                  f"({r['aten_gflops']:.0f} / {r['packed_gflops']:.0f} / "
                  f"{r['colmajor_gflops']:.0f} GF/s)", flush=True)  # fmt: skip
        steps[m] = {"hot_sum": step, "distinct_weights": step_us(m, max(10, args.iters // 10))}
        for kind, s in steps[m].items():
            print(f"M={m:4d} 17 GEMMs of a step ({kind}): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in s.items()))  # fmt: skip
    path = write_json(
        args.out,
        {"isa": cpu_linear.load().isa(), "threads": args.threads, "iters": args.iters,
         "shared_machine": True, "results": results, "per_step_us": steps},
    )  # fmt: skip
    print("wrote", path)


if __name__ == "__main__":
    main()
