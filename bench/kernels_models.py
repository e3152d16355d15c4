"""bench/kernels.py sections at the seed's model shapes (issue 16):

- `moe`: fused MoE (`slimserve_kernels.fused_moe`, two grouped GEMMs) vs the per-expert loop (one
  GEMM pair per active expert through the same per-kind kernels: cuBLAS for BF16, the FP8 and
  INT4 Triton GEMMs) at the expert shapes of GLM-4.5 (H 5120, I 1536, 160 experts) and
  Kimi K2 (H 7168, I 2048, 384 experts), top-8, for 1-256 tokens; BF16 / FP8-block (128 x 128)
  / INT4 (group 32, as Kimi K2's release) experts, every expert distinct in memory.
- `gemm`: FP8-block and INT4 (g128) W*A16 GEMMs, and W8A8 (FP8 per-token-group activations,
  quantization included: impl "w8a8"), vs BF16 at the projection shapes of Llama-3-8B,
  GLM-4.5 and Kimi K2. "w8a8" vs "fp8" (W8A16) per M is what sets `fp8_activations=auto`'s
  rule (app/quant/fp8_activations.py, W8A8_MIN_N). From 1,024 tokens "fp8-torch-dequant" times
  W8A16's earlier prefill path (PyTorch dequantization, then cuBLAS) beside today's "fp8".
- `seed_table`: the seed's comparisons (INT4 vs FP8 decode step, INT4 prefill penalty) per
  model from those rows: one layer's projection GEMMs + its routed experts (fused MoE).

On CPU (`--cpu-smoke`) the same code runs at tiny shapes under TRITON_INTERPRET=1.
"""

from __future__ import annotations

from functools import partial

import torch

# (K, N) of one layer's projections; merged as the engine runs them (qkv, gate_up).
GEMM_SHAPES = {
    "Llama-3-8B": {
        "qkv": (4096, 6144),
        "o": (4096, 4096),
        "gate_up": (4096, 28672),
        "down": (14336, 4096),
    },
    "GLM-4.5": {
        "qkv": (5120, 14336),
        "o": (12288, 5120),
        "shared_gate_up": (5120, 3072),
        "shared_down": (1536, 5120),
    },
    "Kimi K2": {
        "q_a": (7168, 1536),
        "q_b": (1536, 12288),
        "kv_a": (7168, 576),
        "kv_b": (512, 16384),
        "o": (8192, 7168),
        "shared_gate_up": (7168, 4096),
        "shared_down": (2048, 7168),
    },
}
MOE_SHAPES = {"GLM-4.5": (5120, 1536, 160), "Kimi K2": (7168, 2048, 384)}  # H, I, experts
TOP_K = 8
SMOKE_GEMM = {"tiny": {"a": (256, 96), "b": (128, 160)}}
SMOKE_MOE = {"tiny": (128, 64, 12)}
DECODE_TOKENS, PREFILL_TOKENS = (1, 8, 32), (1024, 4096)


def _int4(n: int, k: int, group: int, e: int | None, dtype, gen):
    """Random packed INT4 [.., N, K/8] int32 and scales [.., N, K/g], made on gen's device."""
    lead, dev = (() if e is None else (e,)), gen.device
    shape = (*lead, n, k // 8)
    q = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen, device=dev)
    s = torch.rand(*lead, n, k // group, generator=gen, device=dev) * 0.002 + 0.001
    return q, s.to(dtype)


def _fp8(n: int, k: int, e: int | None, gen):
    """Random e4m3 weight [.., N, K] and 128 x 128 block scales, made on gen's device."""
    lead, dev = (() if e is None else (e,)), gen.device
    w = torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn, device=dev)
    for part in w if e is not None else [w]:  # per expert: Kimi K2's fp32 [E, N, K] is 45 GB
        part.copy_((torch.randn(n, k, generator=gen, device=dev) * 64).clamp(-448, 448))
    s = torch.full((*lead, -(-n // 128), -(-k // 128)), 2.0**-12, device=dev)
    return w, s


def _dense(shape: tuple, dtype, gen) -> torch.Tensor:
    w = torch.empty(shape, dtype=dtype, device=gen.device)
    for part in w if len(shape) == 3 else [w]:  # per expert: no fp32 copy of all of them
        part.copy_(torch.randn(part.shape, generator=gen, device=gen.device) * 0.02)
    return w


def moe_weights(kind: str, h: int, inter: int, e: int, dtype, gen):
    """Every expert distinct in memory (Kimi K2 in BF16: 34 GB), made on the device."""
    from slimserve_kernels.moe_common import MoEWeights

    if kind == "bf16":
        w13, w2 = _dense((e, 2 * inter, h), dtype, gen), _dense((e, h, inter), dtype, gen)
        return MoEWeights("dense", w13, w2)
    if kind == "fp8":
        (w13, s13), (w2, s2) = _fp8(2 * inter, h, e, gen), _fp8(h, inter, e, gen)
        return MoEWeights("fp8", w13, w2, s13, s2, block=(128, 128))
    (w13, s13), (w2, s2) = (_int4(n, k, 32, e, dtype, gen) for n, k in ((2 * inter, h), (h, inter)))
    return MoEWeights("int4", w13, w2, s13, s2, group=32)


def _gemm(kind: str, x, w, e, which: str):
    """One expert's projection through the kernel the per-expert module would call."""
    import slimserve_kernels

    t, s = (w.w13, w.s13) if which == "13" else (w.w2, w.s2)
    if kind == "bf16":
        return x @ t[e].T
    if kind == "fp8":
        return slimserve_kernels.triton_fp8_gemm(x, t[e], s[e], (128, 128))
    return slimserve_kernels.triton_int4_gemm(x, t[e], s[e], None, 32)


def moe_loop(x, tw, ids, w, kind: str):
    """The per-expert loop (MoE.routed_loop's structure): sort, one host sync, per active
    expert gate+up GEMM, SiLU-and-mul, down GEMM, then one weighted index_add."""
    k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w.num_experts).tolist()
    token = order // k
    parts = x.index_select(0, token).split(counts)
    ys = []
    for e, p in enumerate(parts):
        if len(p):
            gate, up = _gemm(kind, p, w, e, "13").chunk(2, -1)
            ys.append(_gemm(kind, torch.nn.functional.silu(gate) * up, w, e, "2"))
    ys = (torch.cat(ys).float() * tw.flatten()[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys)


def bench_moe(shapes: dict, tokens: list[int], kinds, device, dtype, time_ms) -> list[dict]:
    import slimserve_kernels

    gen, rows = torch.Generator(device=device).manual_seed(0), []
    host = torch.Generator().manual_seed(0)  # routing
    for model, (h, inter, e) in shapes.items():
        for kind in kinds:
            w = moe_weights(kind, h, inter, e, dtype, gen)
            for t in tokens:
                x = torch.randn(t, h, generator=gen, device=device).to(dtype)
                ids = torch.stack([torch.randperm(e, generator=host)[:TOP_K] for _ in range(t)])
                ids, tw = ids.to(device), (torch.rand(t, TOP_K, generator=host) + 0.1).to(device)
                fused = slimserve_kernels.triton_fused_moe(x, tw, ids, w)
                loop = moe_loop(x, tw, ids, w, kind)
                err = (fused.float() - loop.float()).abs().max() / loop.float().abs().max()
                args = (x, tw, ids, w)
                f_ms = time_ms(partial(slimserve_kernels.triton_fused_moe, *args), device)
                l_ms = time_ms(partial(moe_loop, *args, kind), device)
                rows.append(
                    dict(
                        op="moe",
                        model=model,
                        impl=kind,
                        m=t,
                        ms=f_ms,
                        loop_ms=l_ms,
                        speedup_vs_loop=l_ms / f_ms,
                        rel_err=float(err),
                    )
                )
            del w
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_gemm(shapes: dict, ms: list[int], device, dtype, time_ms) -> list[dict]:
    import slimserve_kernels
    from slimserve_kernels import reference

    gen, rows = torch.Generator(device=device).manual_seed(0), []
    for model, projs in shapes.items():
        for proj, (k, n) in projs.items():
            wb = _dense((n, k), dtype, gen)
            w8, s8 = _fp8(n, k, None, gen)
            q4, s4 = _int4(n, k, 128, None, dtype, gen)
            for m in ms:
                x = torch.randn(m, k, generator=gen, device=device).to(dtype)
                b8, b4 = (x, w8, s8, (128, 128)), (x, q4, s4, None, 128)
                fns = {
                    "bf16": (partial(torch.matmul, x, wb.T), None),
                    "fp8": (
                        partial(slimserve_kernels.triton_fp8_gemm, *b8),
                        partial(reference.fp8_gemm, *b8),
                    ),
                    "int4": (
                        partial(slimserve_kernels.triton_int4_gemm, *b4),
                        partial(reference.int4_gemm, *b4),
                    ),
                    "w8a8": (  # the activation quantization included, as Fp8Linear runs it
                        partial(slimserve_kernels.triton_fp8_w8a8_gemm, *b8),
                        partial(reference.fp8_w8a8_gemm, *b8),
                    ),
                }
                if m >= 1024:  # W8A16's prefill path before its one-pass Triton dequantization
                    dq = partial(reference.dequantize_fp8_blocks, w8, s8, (128, 128), dtype)
                    fns["fp8-torch-dequant"] = (lambda x=x, dq=dq: x @ dq().T, None)
                for impl, (fn, ref) in fns.items():
                    row = dict(op="model_gemm", model=model, proj=proj, impl=impl, m=m, k=k, n=n)
                    if ref is not None:
                        r = ref().float()
                        row["rel_err"] = float((fn().float() - r).abs().max() / r.abs().max())
                    rows.append(row | dict(ms=time_ms(fn, device)))
    return rows


# The seed's configurations: FP8 = every linear FP8-block (DeepSeek-V3 / Kimi K2 / GLM-4.5-FP8
# releases); INT4 = for MoE models routed experts INT4 g32 and the rest BF16 (Kimi K2's INT4
# release), for a dense model every linear INT4 g128 (weight_quant="int4").
PLANS = {"fp8": ("fp8", "fp8"), "int4": ("bf16", "int4"), "int4-dense": ("int4", None)}


def _ms(rows: list[dict], op: str, model: str, impl: str | None, m: int) -> list[float]:
    key = (model, impl, m)
    return [r["ms"] for r in rows if r["op"] == op and (r["model"], r["impl"], r["m"]) == key]


def layer_ms(rows: list[dict], model: str, plan: str, m: int) -> float | None:
    """One layer's linear time at m tokens: its projection GEMMs + routed experts (fused)."""
    moe_model = any(r["op"] == "moe" and r["model"] == model for r in rows)
    if plan == "int4" and not moe_model:
        plan = "int4-dense"
    gemm_impl, moe_impl = PLANS[plan]
    gemm = _ms(rows, "model_gemm", model, gemm_impl, m)
    moe = _ms(rows, "moe", model, moe_impl, m) if moe_model else [0.0]
    return sum(gemm) + sum(moe) if gemm and moe else None


def seed_table(rows: list[dict], decode=DECODE_TOKENS, prefill=PREFILL_TOKENS) -> list[dict]:
    """The seed's comparisons per model: INT4 vs FP8 layer time at decode batch sizes and
    at prefill lengths (None where a point was not measured: the table is ready to fill)."""
    out = []
    models = sorted({r["model"] for r in rows if r["op"] == "model_gemm"})
    for model in models:
        for phase, ms in (("decode", decode), ("prefill", prefill)):
            for m in ms:
                fp8, int4 = layer_ms(rows, model, "fp8", m), layer_ms(rows, model, "int4", m)
                ratio = fp8 / int4 if fp8 and int4 else None
                out.append(
                    dict(
                        model=model,
                        phase=phase,
                        tokens=m,
                        fp8_ms=fp8,
                        int4_ms=int4,
                        int4_speedup_vs_fp8=ratio,
                    )
                )
    return out


def seed_markdown(table: list[dict]) -> str:
    fmt = lambda v, f: "—" if v is None else format(v, f)  # noqa: E731
    lines = [
        "| model | phase | tokens | FP8 layer ms | INT4 layer ms | INT4 speedup vs FP8 |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in table:
        ms = f"{fmt(r['fp8_ms'], '.3f')} | {fmt(r['int4_ms'], '.3f')}"
        ratio = fmt(r["int4_speedup_vs_fp8"], ".2f")
        lines.append(f"| {r['model']} | {r['phase']} | {r['tokens']} | {ms} | {ratio}x |")
    return "\n".join(lines)


def speedup_markdown(speedups: list[dict], what: str = "W8A8 / W8A16") -> str:
    """A speedup per M: geometric mean, min and max over the models' projections."""
    import math

    lines = [f"| M | {what} speedup (geo. mean) | min | max |", "|---:|---:|---:|---:|"]
    for m in sorted({s["m"] for s in speedups}):
        v = [s["speedup"] for s in speedups if s["m"] == m]
        geo = math.exp(sum(map(math.log, v)) / len(v))
        lines.append(f"| {m} | {geo:.2f}x | {min(v):.2f}x | {max(v):.2f}x |")
    return "\n".join(lines)


def plot(result: dict, path) -> None:
    """Fused MoE over the loop vs tokens; FP8 / INT4 GEMM over BF16 vs M (geometric mean over
    each model's projections)."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    moe = [r for r in result["model_rows"] if r["op"] == "moe"]
    for key in sorted({(r["model"], r["impl"]) for r in moe}):
        pts = sorted((r["m"], r["speedup_vs_loop"]) for r in moe if (r["model"], r["impl"]) == key)
        ax1.plot(*zip(*pts), marker="o", label=" ".join(key))
    ax1.set(xscale="log", xlabel="tokens (top-8)", ylabel="loop ms / fused ms",
            title="Fused MoE vs per-expert loop")  # fmt: skip
    sp = result["model_gemm_speedup"]
    for key in sorted({(s["model"], s["impl"]) for s in sp}):
        by_m: dict[int, list[float]] = {}
        for s in sp:
            if (s["model"], s["impl"]) == key:
                by_m.setdefault(s["m"], []).append(math.log(s["speedup"]))
        pts = sorted((m, math.exp(sum(v) / len(v))) for m, v in by_m.items())
        ax2.plot(*zip(*pts), marker="o", label=" ".join(key))
    ax2.set(xscale="log", xlabel="M (tokens)", ylabel="BF16 ms / ms (geo. mean over projections)",
            title="FP8 (W8A16, W8A8) / INT4 GEMM vs BF16 at model shapes")  # fmt: skip
    for ax in (ax1, ax2):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{result['device']} ({result['mode']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
