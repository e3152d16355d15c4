"""Tiles, split-K and warps of the INT4 GEMV kernel (M <= 4) swept on a GPU, each checked
against the PyTorch reference: the data `int4_gemm_triton.choose_config`'s GEMV entry is set
from (its first table was written without a GPU and read 5-8% of HBM bandwidth on an H200).

    python bench/int4_gemv_sweep.py [--out DIR]      # needs CUDA; ~1-2 minutes

Writes int4_gemv_sweep.json: per (M, K, N) every config's ms, GB/s, relative error, the
current table's config and the best one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (7168, 4096)]  # (K, N)
MS = [1, 4]
BLOCK_N = [32, 64, 128, 256]
BLOCK_K = [64, 128, 256, 512]  # for M = 1; divided by the power of two >= M, as the table does
SPLIT_K = [1, 2, 4, 8, 16]
WARPS = [2, 4, 8]
MAX_TILE = 16384  # BLOCK_N x BLOCK_K values held at once: larger ones spill registers


def configs(m: int):
    import triton

    bm = triton.next_power_of_2(m)
    for bn, bk, split, warps in itertools.product(BLOCK_N, BLOCK_K, SPLIT_K, WARPS):
        if bn * bk <= MAX_TILE and bk // bm >= 8:
            yield dict(path="gemv", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk // bm, split_k=split,
                       num_warps=warps)  # fmt: skip


def sweep_point(m: int, k: int, n: int, gen) -> dict:
    import torch
    from triton.testing import do_bench

    from slimserve_kernels import reference
    from slimserve_kernels.int4_gemm_triton import choose_config, int4_gemm

    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = (torch.rand(n, k // 128, generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x, qweight, scales = x.cuda(), qweight.cuda(), scales.cuda()
    ref = reference.int4_gemm(x, qweight, scales, None, 128).float()
    nbytes = n * k // 2 + scales.numel() * 2 + (m * k + m * n) * 2
    rows = []
    for cfg in configs(m):
        out = int4_gemm(x, qweight, scales, None, 128, config=cfg).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ms = do_bench(lambda cfg=cfg: int4_gemm(x, qweight, scales, None, 128, config=cfg),
                      warmup=5, rep=20)  # fmt: skip
        rows.append(dict(cfg, ms=ms, gbps=nbytes / (ms * 1e-3) / 1e9, rel_err=err))
    dense_w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dense_ms = do_bench(lambda: x @ dense_w.T, warmup=5, rep=20)
    current = {"num_warps": 4, **choose_config(m, n, k)}  # the launch's default warps
    cur = next((r for r in rows if all(r[key] == v for key, v in current.items())), None)
    ok = [r for r in rows if r["rel_err"] < 1e-2]
    best = min(ok, key=lambda r: r["ms"])
    return dict(m=m, k=k, n=n, dense_ms=dense_ms, current=cur, best=best, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this sweep runs on a GPU")
    gen, points, t0 = torch.Generator().manual_seed(0), [], time.time()
    for m in MS:
        for k, n in SHAPES:
            p = sweep_point(m, k, n, gen)
            points.append(p)
            cur, best = p["current"], p["best"]
            keys = ("BLOCK_N", "BLOCK_K", "split_k", "num_warps")
            now = f"{cur['ms'] * 1e3:.1f}" if cur else "?"
            best_us = f"{best['ms'] * 1e3:.1f} us {[best[key] for key in keys]}"
            print(f"M {m} K {k} N {n}: bf16 {p['dense_ms'] * 1e3:.1f} us, table {now} us, "
                  f"best {best_us}", flush=True)  # fmt: skip
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "int4_gemv_sweep.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), wall_s=time.time() - t0,
                               points=points), f)  # fmt: skip


if __name__ == "__main__":
    main()
