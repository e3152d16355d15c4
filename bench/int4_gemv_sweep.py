"""Tiles, K slices, split-K and warps of the K-major W4A16 kernels (`int4_kn_triton`: GEMV at
M <= 4, split-K GEMM at M 8-64) swept on a GPU, each config checked against the PyTorch
reference, and the fastest correct one per (M bucket, N, K, group) written as the GPU's tuned
table (`slimserve_kernels/configs/int4_kn/<GPU>.json`, read by `choose_config`).

    python bench/int4_gemv_sweep.py [--out DIR] [--table-dir DIR]   # needs CUDA; ~2-3 min
    python bench/int4_gemv_sweep.py --smoke --out /tmp/s --table-dir /tmp/t   # interpreted

Timing: triton's do_bench, which flushes L2 before every call (the weights never come from
L2). Writes int4_gemv_sweep.json: per point every config's us, GB/s, relative error, cuBLAS
BF16's us, the fixed rule's config and the best one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import kernel_timer  # noqa: E402

# (K, N, group): Llama-3-8B gate_up / down / o, GLM-4.5 expert gate_up / down (g128), Kimi K2
# expert gate_up / down (its native INT4 is g32).
SHAPES = [(4096, 28672, 128), (14336, 4096, 128), (4096, 4096, 128), (5120, 3072, 128),
          (1536, 5120, 128), (7168, 4096, 32), (2048, 7168, 32)]  # fmt: skip
GEMV_MS, GEMM_MS = [1, 2, 4], [8, 16, 32, 64]
# GEMV: (BLOCK_N, BLOCK_K at M = 1, CHUNKS); BLOCK_K halves per doubling of M past 2.
# Sized to the roofline stage's minutes: each distinct (tile, warps, M, group) is one Triton
# compile (~1 s), the timings are cheap.
GEMV_TILES = [(64, 64, 2), (128, 64, 2), (256, 64, 2), (128, 128, 1), (256, 128, 1),
              (128, 32, 4)]  # fmt: skip
GEMM_TILES = [(64, 64), (128, 32), (64, 128)]  # (BLOCK_N, BLOCK_K), 4 warps
WARPS = [4, 8]  # GEMV
SMOKE = dict(shapes=[(256, 48, 64)], gemv_ms=[1], gemm_ms=[8], gemv_tiles=[(16, 64, 1)],
             gemm_tiles=[(16, 32)], warps=[4])  # fmt: skip
FULL = dict(shapes=SHAPES, gemv_ms=GEMV_MS, gemm_ms=GEMM_MS, gemv_tiles=GEMV_TILES,
            gemm_tiles=GEMM_TILES, warps=WARPS)  # fmt: skip


def configs(m: int, n: int, k: int, group: int, sms: int, grid: dict):
    import triton

    from slimserve_kernels.gemm_common import split_k

    bm = triton.next_power_of_2(m)
    if m <= 4:
        for (bn, bk, chunks), warps in itertools.product(grid["gemv_tiles"], grid["warps"]):
            bk = max(16, bk // max(1, bm // 2))
            yield dict(path="gemv", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CHUNKS=chunks,
                       num_warps=warps)  # fmt: skip
        return
    bm = max(16, bm)
    for bn, bk in grid["gemm_tiles"]:
        if group % bk:
            continue
        rule = split_k(triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk), sms)
        for split in sorted({1, rule, min(16, 2 * rule)}):
            yield dict(path="splitk", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split_k=split,
                       GROUP_M=8, num_warps=4)  # fmt: skip


def sweep_point(m, k, n, group, gen, device, grid) -> dict:
    import torch

    from slimserve_kernels import reference
    from slimserve_kernels.device import num_sms
    from slimserve_kernels.int4_kn_triton import choose_config, int4_gemm_kn
    from slimserve_kernels.int4_layout import Int4KN

    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # interpreter: no bf16 math
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    x, qweight, scales = x.to(device), qweight.to(device), scales.to(device)
    ref = reference.int4_gemm(x, qweight, scales, None, group).float()
    w = Int4KN.of(qweight, scales, None, group)
    nbytes = n * k // 2 + scales.numel() * 2 + (m * k + m * n) * 2
    bench, rows, sms = kernel_timer(device, warmup=5, rep=20), [], num_sms(x)
    for cfg in configs(m, n, k, group, sms, grid):
        try:
            out = int4_gemm_kn(x, w, config=cfg).float()
        except Exception as e:  # registers / shared memory over the limit: not a candidate
            rows.append(dict(cfg, error=str(e).splitlines()[0][:200]))
            continue
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        us = bench(lambda cfg=cfg: int4_gemm_kn(x, w, config=cfg))
        rows.append(dict(cfg, us=us, gbps=nbytes / us / 1e3, rel_err=err))
    dense_w = torch.randn(n, k, generator=gen).to(dtype).to(device)
    dense_us = bench(lambda: x @ dense_w.T)
    rule = choose_config(m, n, k, group, "cpu", sms)  # the fixed rule, never a table
    timed = [r for r in rows if "us" in r]
    best = min((r for r in timed if r["rel_err"] < 1e-2), key=lambda r: r["us"], default=None)
    return dict(m=m, k=k, n=n, group=group, dense_us=dense_us, rule=rule, best=best, rows=rows)


def table_entries(points: list[dict]) -> dict[str, dict]:
    """{'m_bucket,n,k,group': best config} (the launch keys only)."""
    from slimserve_kernels.int4_kn_triton import table_key

    keep = ("path", "BLOCK_M", "BLOCK_N", "BLOCK_K", "CHUNKS", "split_k", "GROUP_M", "num_warps")
    out = {}
    for p in points:
        if p["best"] is not None:
            key = ",".join(str(v) for v in table_key(p["m"], p["n"], p["k"], p["group"]))
            out[key] = {k: p["best"][k] for k in keep if k in p["best"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--table-dir", default=None, help="default: slimserve_kernels/configs")
    ap.add_argument("--smoke", action="store_true", help="tiny grid on CPU (interpreter)")
    args = ap.parse_args()
    if args.smoke:  # before the first triton import
        os.environ["TRITON_INTERPRET"] = "1"
    from pathlib import Path

    import torch

    from slimserve_kernels import tuned
    from slimserve_kernels.int4_kn_triton import TABLE

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this sweep runs on a GPU (or --smoke)")
    grid = SMOKE if args.smoke else FULL
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    gen, points, t0 = torch.Generator().manual_seed(0), [], time.time()
    os.makedirs(args.out, exist_ok=True)
    for m in grid["gemv_ms"] + grid["gemm_ms"]:
        for k, n, group in grid["shapes"]:
            p = sweep_point(m, k, n, group, gen, device, grid)
            points.append(p)
            best = p["best"]
            got = f"{best['us']:.1f} us, {best['gbps']:.0f} GB/s" if best else "none correct"
            print(f"M {m} K {k} N {n} g{group}: bf16 {p['dense_us']:.1f} us, best {got}",
                  flush=True)  # fmt: skip
            with open(os.path.join(args.out, "int4_gemv_sweep.json"), "w") as f:
                json.dump(dict(device=name, wall_s=time.time() - t0, points=points), f)
    root = Path(args.table_dir) if args.table_dir else None
    path = tuned.write_table(TABLE, name, ["m_bucket", "n", "k", "group"], table_entries(points),
                             "bench/int4_gemv_sweep.py", root=root)  # fmt: skip
    print(f"table: {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
