"""Kernel benchmarks: INT4 W4A16 GEMM vs bf16 torch.matmul, FP8 vs BF16 paged decode attention,
and at the seed's model shapes (bench/kernels_models.py): fused MoE vs the per-expert loop,
FP8 (W8A16 and W8A8) / INT4 GEMMs vs BF16, W8A8 vs W8A16, and the seed's INT4-vs-FP8
decode / prefill table.

    python bench/kernels.py              # full grid on a GPU
    python bench/kernels.py --quick      # a subset, < 3 minutes on one GPU
    python bench/kernels.py --cpu-smoke  # tiny shapes, reference vs Triton interpreter (CPU)

Writes kernels.json (+ kernels.png, kernels_models.png) to bench/results/ (or --out). GEMM
shapes are K x N (in x out features): 4096x14336 is a Llama-3-8B up-projection, 14336x4096
its down-projection.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch  # does not import triton; TRITON_INTERPRET can still be set in main()

# Run as a script, bench/ is sys.path[0]: the repo root goes first so `import app` and
# `import slimserve_kernels` resolve to the checkout; bench/ is dropped from the path, where
# this file would shadow the `kernels` package that transformers imports.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from bench import kernels_models as models  # noqa: E402  (imports no triton either)

# Peak HBM bandwidth (GB/s) by device-name substring, for "% of HBM" columns.
HBM_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}
GEMM_SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N)
GEMM_MS = [1, 4, 16, 64, 256, 1024, 4096]
ATTN_CONTEXTS = [1024, 4096, 16384, 32768, 65536, 131072]
ATTN_BATCHES = [1, 8, 32, 64]
ATTN_HEADS = (32, 8, 128)  # Hq, Hkv, D (Llama-3-8B)
MAX_CACHE_BYTES = 40 << 30  # skip attention points whose BF16 cache would exceed this


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="subset of the grid (< 3 min)")
    mode.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, interpreter")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    return p.parse_args()


def grids(args) -> dict:
    if args.cpu_smoke:
        return dict(
            gemm_shapes=[(256, 96)],
            gemm_ms=[1, 5, 33],
            group=128,
            contexts=[40, 130],
            batches=[1, 3],
            heads=(4, 2, 32),
            block_size=16,
            model_gemm=models.SMOKE_GEMM,
            moe=models.SMOKE_MOE,
            model_ms=[1, 5],
            seed_points=((1,), (5,)),
        )
    if args.quick:
        return dict(
            gemm_shapes=GEMM_SHAPES,
            gemm_ms=[1, 16, 1024, 4096],
            group=128,
            contexts=[1024, 8192, 32768],
            batches=[1, 32],
            heads=ATTN_HEADS,
            block_size=16,
            model_gemm=models.GEMM_SHAPES,
            moe=models.MOE_SHAPES,
            model_ms=[1, 8, 32, 256, 1024, 4096],
            seed_points=(models.DECODE_TOKENS, models.PREFILL_TOKENS),
        )
    return dict(
        gemm_shapes=GEMM_SHAPES,
        gemm_ms=GEMM_MS,
        group=128,
        contexts=ATTN_CONTEXTS,
        batches=ATTN_BATCHES,
        heads=ATTN_HEADS,
        block_size=16,
        model_gemm=models.GEMM_SHAPES,
        moe=models.MOE_SHAPES,
        model_ms=[1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096],
        seed_points=(models.DECODE_TOKENS, models.PREFILL_TOKENS),
    )


def time_ms(fn, device) -> float:
    """Milliseconds per call: CUDA, triton's do_bench (median); CPU smoke, one wall-clock run
    (interpreter timings only show that the plumbing works, so keep them cheap)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10, rep=40))
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def gemm_inputs(m, k, n, group, device, dtype, gen):
    qweight = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    x = torch.randn(m, k, generator=gen)
    return x.to(device, dtype), qweight.to(device), scales.to(device, dtype)


def bench_gemm_point(m, k, n, group, device, dtype, gen) -> list[dict]:
    """One (M, K, N): bf16 matmul, INT4 default path, and the other INT4 paths for M >= 256."""
    from slimserve_kernels import reference
    from slimserve_kernels.int4_gemm_triton import choose_config, int4_gemm

    x, qweight, scales = gemm_inputs(m, k, n, group, device, dtype, gen)
    q = reference.unpack_int4(qweight).to(dtype)  # [N, K], the dense baseline's weight
    w = (q - 8) * scales.repeat_interleave(group, dim=1)
    ref = reference.int4_gemm(x, qweight, scales, None, group)
    int4_bytes = n * k // 2 + scales.numel() * scales.element_size()
    act_bytes = (m * k + m * n) * x.element_size()
    rows = [
        dict(
            op="gemm",
            impl="dense",
            m=m,
            k=k,
            n=n,
            ms=time_ms(lambda: x @ w.T, device),
            bytes=n * k * w.element_size() + act_bytes,
        )
    ]
    default = choose_config(m, n, k)
    configs = [("int4", default)]
    if m >= 256 and device.type == "cuda":
        other = dict(path="dequant", split_k=1)
        if default["path"] == "dequant":
            other = choose_config(min(m, 1023), n, k)  # the fused tiled kernel
        configs.append((f"int4-{other['path']}", other))
    for impl, cfg in configs:
        out = int4_gemm(x, qweight, scales, None, group, config=cfg)
        err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
        fn = lambda cfg=cfg: int4_gemm(x, qweight, scales, None, group, config=cfg)
        rows.append(
            dict(
                op="gemm",
                impl=impl,
                path=cfg["path"],
                split_k=cfg["split_k"],
                m=m,
                k=k,
                n=n,
                ms=time_ms(fn, device),
                bytes=int4_bytes + act_bytes,
                rel_err=err,
            )
        )
    return rows


def random_e4m3(shape, device) -> torch.Tensor:
    """Random e4m3 codes without NaNs (0x7F/0xFF), made as bytes: cheap for 10+ GB caches."""
    mag = torch.randint(0, 0x7F, shape, dtype=torch.uint8, device=device)
    sign = torch.randint(0, 2, shape, dtype=torch.uint8, device=device) << 7
    return (mag | sign).view(torch.float8_e4m3fn)


def paged_cache(batch, ctx, heads, block_size, fp8: bool, device, gen):
    """Random cache holding batch x ctx tokens in shuffled blocks, and its block tables."""
    _, hkv, d = heads
    blocks_per_seq = -(-ctx // block_size)
    nb = batch * blocks_per_seq
    shape = (nb, block_size, hkv, d)
    if fp8:
        k, v = random_e4m3(shape, device), random_e4m3(shape, device)
        ks = torch.randint(-8, -4, shape[:3], dtype=torch.int8, device=device)
        vs = torch.randint(-8, -4, shape[:3], dtype=torch.int8, device=device)
    else:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # no bf16 on CPU
        k = torch.randn(shape, device=device, dtype=dtype)
        v, ks, vs = torch.randn_like(k), None, None
    perm = torch.randperm(nb, generator=gen).to(device=device, dtype=torch.int32)
    tables = perm.view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return (k, v, ks, vs), tables, lens


def bench_attention_point(batch, ctx, heads, block_size, device, gen) -> list[dict]:
    from slimserve_kernels import reference
    from slimserve_kernels.paged_decode import choose_num_splits, paged_decode_attention

    hq, hkv, d = heads
    qdtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(batch, hq, d, generator=gen).to(device, qdtype)
    rows = []
    for fp8 in (True, False):
        cache, tables, lens = paged_cache(batch, ctx, heads, block_size, fp8, device, gen)
        args = (q, *cache, tables, lens, d**-0.5)
        fn = lambda args=args: paged_decode_attention(*args)
        row = dict(
            op="decode_attention",
            impl="fp8" if fp8 else "bf16",
            batch=batch,
            ctx=ctx,
            hq=hq,
            hkv=hkv,
            d=d,
            ms=time_ms(fn, device),
            num_splits=choose_num_splits(batch, hkv, tables.shape[1] * block_size),
            bytes=sum(t.numel() * t.element_size() for t in cache if t is not None),
        )
        if device.type == "cpu":  # smoke: the interpreter against the reference
            ref = reference.paged_decode_attention(*args)
            row["max_abs_err"] = (fn().float() - ref.float()).abs().max().item()
        rows.append(row)
        del cache, args, fn  # free this cache before allocating the next one
    return rows


def add_bandwidth(rows: list[dict], hbm_gbps: float | None) -> None:
    for r in rows:
        r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
        if hbm_gbps:
            r["hbm_fraction"] = r["gbps"] / hbm_gbps


def speedups(rows: list[dict], op: str, key: tuple, fast: str, slow: str) -> list[dict]:
    """[{key..., speedup}] where speedup = slow.ms / fast.ms for matching points."""
    by = {(r["impl"], *(r[k] for k in key)): r for r in rows if r["op"] == op}
    out = []
    for (impl, *vals), r in by.items():
        base = by.get((slow, *vals))
        if impl == fast and base:
            out.append({**dict(zip(key, vals)), "impl": fast, "speedup": base["ms"] / r["ms"]})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for k, n in {(s["k"], s["n"]) for s in result["gemm_speedup"]}:
        pts = sorted(
            (s["m"], s["speedup"]) for s in result["gemm_speedup"] if (s["k"], s["n"]) == (k, n)
        )
        ax1.plot(*zip(*pts), marker="o", label=f"K={k} N={n}")
    ax1.set(
        xscale="log",
        xlabel="M (tokens)",
        ylabel="dense ms / INT4 ms",
        title="INT4 W4A16 GEMM speedup",
    )
    for b in sorted({s["batch"] for s in result["attention_speedup"]}):
        pts = sorted(
            (s["ctx"], s["speedup"]) for s in result["attention_speedup"] if s["batch"] == b
        )
        ax2.plot(*zip(*pts), marker="o", label=f"batch {b}")
    ax2.set(
        xscale="log",
        xlabel="context (tokens)",
        ylabel="BF16 ms / FP8 ms",
        title="FP8 vs BF16 decode attention",
    )
    for ax in (ax1, ax2):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['device']} ({result['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args, device, save=lambda partial: None) -> dict:
    """The benchmark's result; save(result so far) is called after each section, so a run cut
    short (a lent GPU's time limit) still leaves what it measured."""
    g = grids(args)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    rows = []
    for k, n in g["gemm_shapes"]:
        for m in g["gemm_ms"]:
            rows += bench_gemm_point(m, k, n, g["group"], device, dtype, gen)
    for ctx in g["contexts"]:
        for batch in g["batches"]:
            hq, hkv, d = g["heads"]
            if batch * ctx * hkv * d * 4 > MAX_CACHE_BYTES:
                continue
            rows += bench_attention_point(batch, ctx, g["heads"], g["block_size"], device, gen)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    hbm = next((v for key, v in HBM_GBPS.items() if key in name), None)
    add_bandwidth(rows, hbm)
    save(dict(partial=True, device=name, rows=rows))
    model_rows = []
    for model, shape in g["moe"].items():
        kinds = ("bf16", "fp8", "int4")
        model_rows += models.bench_moe({model: shape}, g["model_ms"], kinds, device, dtype, time_ms)
        save(dict(partial=True, device=name, rows=rows, model_rows=model_rows))
    model_rows += models.bench_gemm(g["model_gemm"], g["model_ms"], device, dtype, time_ms)
    import triton

    return dict(
        mode="cpu-smoke" if args.cpu_smoke else "quick" if args.quick else "full",
        device=name,
        hbm_gbps=hbm,
        torch=torch.__version__,
        triton=triton.__version__,
        rows=rows,
        gemm_speedup=speedups(rows, "gemm", ("m", "k", "n"), "int4", "dense"),
        attention_speedup=speedups(rows, "decode_attention", ("batch", "ctx"), "fp8", "bf16"),
        model_rows=model_rows,
        model_gemm_speedup=[
            s
            for impl in ("fp8", "int4", "w8a8")
            for s in speedups(model_rows, "model_gemm", ("model", "proj", "m"), impl, "bf16")
        ],
        # W8A8 over W8A16 per projection and M: where it is > 1 is fp8_activations=auto's rule.
        w8a8_vs_w8a16=speedups(model_rows, "model_gemm", ("model", "proj", "m"), "w8a8", "fp8"),
        # W8A16's prefill path (M >= 1024): the one-pass Triton dequantization over PyTorch's.
        fp8_dequant_gain=speedups(
            model_rows, "model_gemm", ("model", "proj", "m"), "fp8", "fp8-torch-dequant"
        ),
        seed_table=models.seed_table(model_rows, *g["seed_points"]),
    )


def main() -> None:
    args = parse_args()
    if args.cpu_smoke:  # must precede the first triton import
        os.environ["TRITON_INTERPRET"] = "1"
    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke, or on a GPU")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_smoke" if args.cpu_smoke else "kernels"

    def save(partial: dict) -> None:
        partial["wall_s"] = time.time() - t0
        (out / f"{stem}.json").write_text(json.dumps(partial, indent=1))

    result = run(args, device, save)
    result["wall_s"] = time.time() - t0
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    plot(result, out / f"{stem}.png")
    models.plot(result, out / f"{stem}_models.png")
    print(json.dumps({k: result[k] for k in ("gemm_speedup", "attention_speedup")}, indent=1))
    print(models.seed_markdown(result["seed_table"]))
    print(models.speedup_markdown(result["w8a8_vs_w8a16"]))
    if result["fp8_dequant_gain"]:
        print(models.speedup_markdown(result["fp8_dequant_gain"], "Triton / PyTorch dequant"))
    print(f"wrote {out / stem}.json and .png in {result['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
