"""Tiles, pipeline stages, warps and split-K of the W8A8 FP8 block GEMM swept on a GPU from
decode to prefill sizes, each config checked against the PyTorch reference, and the fastest
correct one per (M bucket, N, K) written as the GPU's tuned table
(`slimserve_kernels/configs/fp8_w8a8/<GPU>.json`, read by `fp8_w8a8_triton.choose_config`).

    python bench/fp8_gemm_sweep.py [--out DIR] [--table-dir DIR]   # needs CUDA; ~2-3 minutes
    python bench/fp8_gemm_sweep.py --smoke --out /tmp/s --table-dir /tmp/t  # interpreted

Timing: triton's do_bench (L2 flushed before every call). Writes fp8_gemm_sweep.json: per
(M, K, N) every config's ms and relative error, cuBLAS BF16's ms, the rule's config and the
fastest correct one.
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

# (K, N): Llama-3-8B gate_up / down, GLM-4.5 q (5120 -> 96 x 128), Kimi K2 kv_a (narrow N)
# and q_b (short K)
SHAPES = [(4096, 28672), (14336, 4096), (5120, 12288), (7168, 576), (1536, 12288)]
MS = [1, 16, 64, 256, 1024, 4096]
SMALL_TILES = [(16, 64), (16, 128), (32, 128), (64, 64)]  # (BLOCK_M, BLOCK_N) for M <= 64
TILES = [(64, 128), (128, 64), (128, 128), (128, 256)]
SMALL_WARPS, WARPS, STAGES = [4], [4, 8], [3, 4]
SMOKE = dict(shapes=[(256, 96)], ms=[40], small_tiles=[(16, 32), (64, 64)], tiles=[],
             small_warps=[4], warps=[4], stages=[3])  # fmt: skip
FULL = dict(shapes=SHAPES, ms=MS, small_tiles=SMALL_TILES, tiles=TILES, small_warps=SMALL_WARPS,
            warps=WARPS, stages=STAGES)  # fmt: skip


def configs(m: int, n: int, k: int, sms: int, grid: dict):
    """Every tile x warps x stages for this M, each with no split-K, the rule's split-K and
    twice it (small M: too few tiles to fill the SMs)."""
    import triton

    from slimserve_kernels.gemm_common import split_k

    small = m <= 64
    tiles = grid["small_tiles"] if small else grid["tiles"]
    warps = grid["small_warps"] if small else grid["warps"]
    for (bm, bn), w, stages in itertools.product(tiles, warps, grid["stages"]):
        rule = split_k(triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, 128), sms)
        for split in sorted({1, rule, min(16, 2 * rule)} if small else {1, rule}):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w,
                       num_stages=stages, split_k=split)  # fmt: skip


def sweep_point(m: int, k: int, n: int, gen, device: str, grid: dict) -> dict:
    import torch

    from slimserve_kernels import reference
    from slimserve_kernels.device import num_sms
    from slimserve_kernels.fp8_act_quant_triton import quantize_fp8_token_groups
    from slimserve_kernels.fp8_w8a8_triton import choose_config, fp8_block_gemm

    block, bench = (128, 128), kernel_timer(device, warmup=5, rep=25, scale=1.0)
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(reference.FP8_DTYPE)
    s = torch.exp2(torch.randint(-14, -9, (-(-n // 128), -(-k // 128)), generator=gen)).float()
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    x, w, s = x.to(device), w.to(device), s.to(device)
    q, qs = quantize_fp8_token_groups(x)
    ref = reference.fp8_block_gemm(q, qs, w, s, block, torch.float32)
    rows = []
    sms = num_sms(x)
    for cfg in configs(m, n, k, sms, grid):
        try:
            out = fp8_block_gemm(q, qs, w, s, block, torch.bfloat16, config=cfg).float()
        except Exception as e:  # shared memory / registers over the limit: not a candidate
            rows.append(dict(cfg, error=str(e).splitlines()[0][:200]))
            continue
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        ms = bench(lambda cfg=cfg: fp8_block_gemm(q, qs, w, s, block, torch.bfloat16, config=cfg))
        rows.append(dict(cfg, ms=ms, rel_err=err))
    dense_w = torch.randn(n, k, generator=gen).to(torch.bfloat16).to(device)
    xd = x.to(device)
    dense_ms = bench(lambda: xd @ dense_w.T)
    current = {"num_stages": 3, **choose_config(m, n, k, 128, sms)}  # the rule, no table
    timed = [r for r in rows if "ms" in r]
    cur = next((r for r in timed if all(r.get(key) == v for key, v in current.items())), None)
    best = min((r for r in timed if r["rel_err"] < 1e-2), key=lambda r: r["ms"], default=None)
    return dict(m=m, k=k, n=n, dense_ms=dense_ms, current=current, current_row=cur, best=best,
                rows=rows)  # fmt: skip


def describe(p: dict) -> str:
    cur, best = p["current_row"], p["best"]
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "split_k")
    now = f"{cur['ms'] * 1e3:.0f} us" if cur else "untimed"
    fast = f"{best['ms'] * 1e3:.0f} us {[best[k] for k in keys]}" if best else "none correct"
    head = f"M {p['m']} K {p['k']} N {p['n']}: bf16 {p['dense_ms'] * 1e3:.0f} us"
    return f"{head}, table {now}, best {fast}"


def table_entries(points: list[dict]) -> dict[str, dict]:
    """{'m_bucket,n,k': best config} (the launch keys only)."""
    from slimserve_kernels.fp8_w8a8_triton import table_key

    keep = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "split_k")
    return {",".join(map(str, table_key(p["m"], p["n"], p["k"]))): {k: p["best"][k] for k in keep}
            for p in points if p["best"] is not None}  # fmt: skip


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
    from slimserve_kernels.fp8_w8a8_triton import TABLE

    grid = SMOKE if args.smoke else FULL
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this sweep runs on a GPU (or --smoke)")
    gen, points, t0 = torch.Generator().manual_seed(0), [], time.time()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    for m in grid["ms"]:
        for k, n in grid["shapes"]:
            points.append(sweep_point(m, k, n, gen, device, grid))
            print(describe(points[-1]), flush=True)
            with open(os.path.join(args.out, "fp8_gemm_sweep.json"), "w") as f:
                json.dump(dict(device=name, wall_s=time.time() - t0, points=points), f)
    root = Path(args.table_dir) if args.table_dir else None
    path = tuned.write_table(TABLE, name, ["m_bucket", "n", "k"], table_entries(points),
                             "bench/fp8_gemm_sweep.py", root=root)  # fmt: skip
    print(f"table: {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
