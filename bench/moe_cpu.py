"""CPU MoE: the fused sorted-layout path (`slimserve_kernels.moe_common.fused_moe_torch`, what
`MoE.routed` runs on CPU) vs the per-expert module loop (`MoE.routed_loop`), at the expert
shapes of GLM-4.5 (H 5120, I 1536, 160 experts) and Kimi K2 (H 7168, I 2048, 384 experts),
top-8, 1-64 tokens, float32 (the CPU activation dtype), dense and FP8-block experts.

Both paths run on the same stacked weights, as in a loaded model (the experts' parameters
are views of the stacks). All experts share one expert's storage (a stride-0 expand), since
384 distinct real-shape experts do not fit in memory here: each active expert's weights
(63-117 MB in fp32) still stream from DRAM, as they exceed the caches. Routing is uniform
random top-8 (distinct experts per token). Median of `--reps` runs after one warm-up, the
two paths interleaved run by run.

    python bench/moe_cpu.py [--quick]   # -> bench/results/moe_cpu.json + .png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.models.moe import GatedMLP, MoE  # noqa: E402
from app.quant.fp8 import quantize_fp8_block  # noqa: E402
from app.quant.fp8_linear import Fp8Linear  # noqa: E402
from bench.common import RESULTS, write_json  # noqa: E402
from slimserve_kernels.moe_common import MoEWeights, fused_moe_torch  # noqa: E402

SHAPES = {"GLM-4.5": (5120, 1536, 160), "Kimi K2": (7168, 2048, 384)}  # H, I, experts
TOKENS = [1, 2, 4, 8, 16, 32, 64]
TOP_K = 8


def stacked(h: int, inter: int, e: int, kind: str) -> MoEWeights:
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(2 * inter, h, generator=gen) * 0.02
    w2 = torch.randn(h, inter, generator=gen) * 0.02
    if kind == "dense":
        return MoEWeights("dense", w13.expand(e, -1, -1), w2.expand(e, -1, -1))
    (q13, s13), (q2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    ex = lambda t: t.expand(e, *t.shape)  # noqa: E731
    return MoEWeights("fp8", ex(q13), ex(q2), ex(s13), ex(s2), block=(128, 128))


def expert_modules(w: MoEWeights) -> nn.ModuleList:
    """`GatedMLP`s whose parameters are views of the stacks (as after `stack_experts`)."""
    h, inter = w.w13.shape[2], w.intermediate
    param = lambda t: nn.Parameter(t, requires_grad=False)  # noqa: E731
    mods = []
    for e in range(w.num_experts):
        with torch.device("meta"):  # no storage: every tensor below is a view of a stack
            m = GatedMLP(h, inter)
            if w.kind == "fp8":
                m.gate_up_proj = Fp8Linear(h, 2 * inter, w.block)
                m.down_proj = Fp8Linear(inter, h, w.block)
        m.gate_up_proj.weight, m.down_proj.weight = param(w.w13[e]), param(w.w2[e])
        if w.kind == "fp8":
            m.gate_up_proj.weight_scale_inv = param(w.s13[e])
            m.down_proj.weight_scale_inv = param(w.s2[e])
        mods.append(m)
    return nn.ModuleList(mods)


def paired_median_ms(fns: list, reps: int) -> tuple[list[float], list[float]]:
    """(median wall ms, median CPU ms) of each fn, the fns interleaved run by run so that load
    from other processes hits them alike; one warm-up each. CPU time (all threads of this
    process) is the steadier figure on a shared machine."""
    for fn in fns:
        fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append((time.perf_counter() - t0) * 1e3)
            cpu[i].append((time.process_time() - c0) * 1e3)
    med = statistics.median
    return [med(t) for t in wall], [med(t) for t in cpu]


def routing(t: int, e: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(e, generator=gen)[:TOP_K] for _ in range(t)])
    return torch.rand(t, TOP_K, generator=gen) + 0.1, ids


@torch.no_grad()
def bench_shape(name: str, kind: str, tokens: list[int], reps: int) -> list[dict]:
    """Both paths at each token count; the loop's output is the fused path's reference."""
    h, inter, e = SHAPES[name]
    w = stacked(h, inter, e, kind)
    loop = SimpleNamespace(experts=expert_modules(w), local=range(e))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=gen)
        tw, ids = routing(t, e, gen)
        fused = fused_moe_torch(x, tw, ids, w)
        looped = MoE.routed_loop(loop, x, tw, ids)
        err = float((fused - looped).abs().max() / looped.abs().max())
        args = (x, tw, ids)
        (f_ms, l_ms), (f_cpu, l_cpu) = paired_median_ms(
            [lambda a=args: fused_moe_torch(*a, w), lambda a=args: MoE.routed_loop(loop, *a)], reps
        )
        active = int(ids.unique().numel())
        rows.append(
            dict(
                model=name,
                kind=kind,
                tokens=t,
                active_experts=active,
                fused_ms=f_ms,
                loop_ms=l_ms,
                loop_over_fused=l_ms / f_ms,
                fused_cpu_ms=f_cpu,
                loop_cpu_ms=l_cpu,
                loop_over_fused_cpu=l_cpu / f_cpu,
                rel_err=err,
            )  # fmt: skip
        )
        ratios = f"loop/fused {l_ms / f_ms:.3f} (CPU time {l_cpu / f_cpu:.3f})"
        print(f"{name} {kind} T={t:3d} active={active:3d} fused {f_ms:8.1f} ms "
              f"loop {l_ms:8.1f} ms  {ratios}", flush=True)  # fmt: skip
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r["model"], r["kind"]) for r in rows}):
        sel = [r for r in rows if (r["model"], r["kind"]) == key]
        for metric, style in (("loop_over_fused_cpu", "-"), ("loop_over_fused", ":")):
            pts = [(r["tokens"], r[metric]) for r in sel]
            what = "CPU time" if metric.endswith("cpu") else "wall"
            ax.plot(*zip(*pts), style, marker="o", label=f"{key[0]} {key[1]} ({what})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", xlabel="tokens (top-8)", ylabel="loop ms / fused ms (>1: fused faster)",
           title="CPU MoE: fused sorted layout vs per-expert loop (fp32)")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="GLM-4.5 dense only, 1/8/64 tokens")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default=None, help="e.g. GLM-4.5:dense,Kimi K2:fp8")
    p.add_argument("--tokens", default=None, help="comma-separated (default 1..64)")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.add_argument("--append", action="store_true", help="add to the rows already in the JSON")
    args = p.parse_args()
    tokens = [1, 8, 64] if args.quick else TOKENS
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    cases = [(m, k) for m in SHAPES for k in ("dense", "fp8")]
    if args.quick:
        cases = [("GLM-4.5", "dense")]
    if args.cases:
        cases = [tuple(c.split(":")) for c in args.cases.split(",")]
    extra = {"out_dir": args.out} if args.out else {}
    rows: list[dict] = []
    if args.append:  # e.g. a case measured later, at other token counts
        with open(os.path.join(args.out or RESULTS, "moe_cpu.json")) as f:
            rows = json.load(f)["rows"]
    for m, k in cases:  # results written after each case: a long run keeps what it measured
        rows += bench_shape(m, k, tokens, args.reps)
        meta = dict(threads=torch.get_num_threads(), reps=args.reps, load=os.getloadavg())
        path = write_json("moe_cpu", dict(**meta, rows=rows), **extra)
        plot(rows, path.removesuffix(".json") + ".png")
    print(path)


if __name__ == "__main__":
    main()
