"""Our INT4 W4A16, W8A8 FP8 and FP8-cache decode attention kernels beside cuBLAS BF16, GemLite
(when importable) and the BF16-cache kernel, at the Llama-3-8B / GLM-4.5 / Kimi K2 shapes, in
one run: the issue-35 table.

    python bench/gpu_roofline.py [--out DIR]         # one GPU, after the sweeps wrote tables
    python bench/gpu_roofline.py --smoke --out DIR   # tiny shapes on CPU (interpreter)

Every contender is timed by triton's do_bench, which flushes L2 before each call, so weights
and KV come from HBM for all of them. Writes gpu_roofline.json, one row per kernel x shape x
M (or context): kernel, shape, m_or_ctx, device, ours_us, cublas_bf16_us or bf16_cache_us,
gemlite_us (INT4, None where GemLite is not importable), ratio (the contender's time over
ours, > 1: ours is faster), pct_of_hbm (our bytes / time over the GPU's peak), rel_err
(ours vs the PyTorch reference), and gpu_roofline.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import kernel_timer  # noqa: E402

INT4_SHAPES = [("llama3_8b.gate_up", 4096, 28672, 128), ("llama3_8b.down", 14336, 4096, 128),
               ("glm45.expert_gate_up", 5120, 3072, 128),
               ("kimi_k2.expert_gate_up", 7168, 4096, 32)]  # fmt: skip
INT4_MS = [1, 2, 4, 8, 16, 32, 64, 256, 1024]
FP8_SHAPES = [("llama3_8b.gate_up", 4096, 28672), ("llama3_8b.down", 14336, 4096),
              ("glm45.q", 5120, 12288), ("kimi_k2.kv_a", 7168, 576),
              ("kimi_k2.q_b", 1536, 12288)]  # fmt: skip
FP8_MS = [1, 16, 64, 256, 1024, 4096]
ATTN = dict(hq=32, hkv=8, d=128, block=16, ctx=[1024, 8192, 32768], batch=[1, 8, 32])
FULL = dict(int4=(INT4_SHAPES, INT4_MS), fp8=(FP8_SHAPES, FP8_MS), attn=ATTN)
SMOKE = dict(int4=([("tiny", 256, 48, 64)], [1, 5]), fp8=([("tiny", 256, 96)], [1, 40]),
             attn=dict(hq=4, hkv=2, d=32, block=16, ctx=[40], batch=[2]))  # fmt: skip
PEAK_HBM = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}  # bytes/s, by name


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_HBM.items() if key in name), None)


def rel_err(out, ref) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def gemlite_int4(qweight, scales, group: int, dtype):
    """A GemLite W4A16 layer of the same weight (symmetric: zero point 8), or (None, why)."""
    try:
        from gemlite.core import DType, GemLiteLinear

        from slimserve_kernels.reference import unpack_int4

        n, k = qweight.shape[0], qweight.shape[1] * 8
        gdt = DType.BF16 if dtype.is_floating_point and dtype.itemsize == 2 else DType.FP32
        layer = GemLiteLinear(4, group_size=group, in_features=k, out_features=n,
                              input_dtype=gdt, output_dtype=gdt)  # fmt: skip
        zeros = torch_full_like(scales, 8.0)
        layer.pack(unpack_int4(qweight), scales, zeros, None)
        return layer, None
    except Exception as e:  # not installed, or an API this harness does not know
        return None, f"{type(e).__name__}: {str(e)[:160]}"


def torch_full_like(t, value):
    import torch

    return torch.full_like(t, value)


def int4_rows(spec, device, name, bench, gen, dtype) -> list[dict]:
    import torch

    from slimserve_kernels import reference
    from slimserve_kernels.int4_kn_triton import int4_gemm_kn
    from slimserve_kernels.int4_layout import Int4KN

    shapes, ms = spec
    rows, peak = [], peak_bandwidth(name)
    for label, k, n, group in shapes:
        qw = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=gen)
        s = (torch.rand(n, k // group, generator=gen) * 0.01 + 0.001).to(dtype)
        qw, s = qw.to(device), s.to(device)
        w = Int4KN.of(qw, s, None, group)
        dense = reference.int4_gemm(torch.eye(k, device=device, dtype=dtype), qw, s, None, group)
        dense = dense.T.contiguous()  # [N, K] in dtype: cuBLAS's operand
        glite, why = gemlite_int4(qw, s, group, dtype) if device == "cuda" else (None, "cpu")
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(dtype).to(device)
            ours_us = bench(lambda x=x, w=w: int4_gemm_kn(x, w))
            err = rel_err(int4_gemm_kn(x, w), reference.int4_gemm(x, qw, s, None, group))
            dense_us = bench(lambda x=x, dense=dense: x @ dense.T)
            glite_us = bench(lambda x=x, g=glite: g(x)) if glite is not None else None
            nbytes = n * k // 2 + s.numel() * s.element_size() + (m * k + m * n) * 2
            rows.append(dict(kernel="int4_w4a16", shape=f"{label} K{k} N{n} g{group}",
                             m_or_ctx=m, device=name, ours_us=ours_us, cublas_bf16_us=dense_us,
                             gemlite_us=glite_us, gemlite_note=why, ratio=dense_us / ours_us,
                             gemlite_ratio=glite_us / ours_us if glite_us else None,
                             pct_of_hbm=_pct(nbytes, ours_us, peak), rel_err=err))  # fmt: skip
    return rows


def fp8_rows(spec, device, name, bench, gen, dtype) -> list[dict]:
    import torch

    from slimserve_kernels import reference
    from slimserve_kernels.fp8_w8a8_triton import fp8_w8a8_gemm

    shapes, ms = spec
    rows, peak, block = [], peak_bandwidth(name), (128, 128)
    for label, k, n in shapes:
        w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(reference.FP8_DTYPE)
        sc = torch.exp2(torch.randint(-14, -9, (-(-n // 128), -(-k // 128)), generator=gen))
        w, sc = w.to(device), sc.float().to(device)
        dense = reference.dequantize_fp8_blocks(w, sc, block, dtype)  # [N, K]
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(dtype).to(device)
            ours_us = bench(lambda x=x, w=w, sc=sc: fp8_w8a8_gemm(x, w, sc, block))
            ref = reference.fp8_w8a8_gemm(x, w, sc, block)
            err = rel_err(fp8_w8a8_gemm(x, w, sc, block), ref)
            dense_us = bench(lambda x=x, dense=dense: x @ dense.T)
            nbytes = n * k + sc.numel() * 4 + (m * k + m * n) * 2
            rows.append(dict(kernel="fp8_w8a8", shape=f"{label} K{k} N{n}", m_or_ctx=m,
                             device=name, ours_us=ours_us, cublas_bf16_us=dense_us,
                             ratio=dense_us / ours_us, pct_of_hbm=_pct(nbytes, ours_us, peak),
                             rel_err=err))  # fmt: skip
    return rows


def paged_cache(dtype, batch, ctx, a, gen, device):
    import torch

    from slimserve_kernels.reference import FP8_DTYPE

    blocks = batch * -(-ctx // a["block"])
    shape = (blocks, a["block"], a["hkv"], a["d"])
    k = torch.randn(shape, generator=gen).to(dtype).to(device)
    v = torch.randn(shape, generator=gen).to(dtype).to(device)
    scales = (None, None)
    if dtype == FP8_DTYPE:
        e = torch.randint(-3, 1, shape[:3], generator=gen, dtype=torch.int8).to(device)
        scales = (e, e.clone())
    table = torch.randperm(blocks, generator=gen).to(torch.int32).view(batch, -1).to(device)
    return (k, v, *scales), table


def attention_rows(a, device, name, bench, gen, q_dtype, half_dtype) -> list[dict]:
    import torch

    from slimserve_kernels import reference
    from slimserve_kernels.paged_decode import paged_decode_attention
    from slimserve_kernels.reference import FP8_DTYPE

    rows, peak, d = [], peak_bandwidth(name), a["d"]
    for ctx in a["ctx"]:
        for b in a["batch"]:
            q = torch.randn(b, a["hq"], d, generator=gen).to(q_dtype).to(device)
            lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
            us, errs = {}, {}
            for dt in (FP8_DTYPE, half_dtype):
                cache, table = paged_cache(dt, b, ctx, a, gen, device)
                args = (q, *cache, table, lens, d**-0.5)
                us[dt] = bench(lambda args=args: paged_decode_attention(*args))
                errs[dt] = rel_err(paged_decode_attention(*args),
                                   reference.paged_decode_attention(*args))  # fmt: skip
                del cache
            kv = b * ctx * a["hkv"] * d * 2
            fp8_bytes, half_bytes = kv + 2 * b * ctx * a["hkv"], kv * 2
            shape = f"B{b} Hq{a['hq']} Hkv{a['hkv']} D{d}"
            rows.append(dict(kernel="decode_attention_fp8", shape=shape, m_or_ctx=ctx,
                             device=name, ours_us=us[FP8_DTYPE], bf16_cache_us=us[half_dtype],
                             ratio=us[half_dtype] / us[FP8_DTYPE],
                             pct_of_hbm=_pct(fp8_bytes, us[FP8_DTYPE], peak),
                             rel_err=errs[FP8_DTYPE]))  # fmt: skip
            rows.append(dict(kernel="decode_attention_bf16", shape=shape, m_or_ctx=ctx,
                             device=name, ours_us=us[half_dtype], bf16_cache_us=us[half_dtype],
                             ratio=1.0, pct_of_hbm=_pct(half_bytes, us[half_dtype], peak),
                             rel_err=errs[half_dtype]))  # fmt: skip
    return rows


def _pct(nbytes: int, us: float, peak: float | None) -> float | None:
    return None if peak is None else 100 * nbytes / (us * 1e-6) / peak


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = ["int4_w4a16", "fp8_w8a8", "decode_attention_fp8"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    for ax, kern in zip(axes, kernels):
        for shape in sorted({r["shape"] for r in rows if r["kernel"] == kern}):
            pts = [r for r in rows if r["kernel"] == kern and r["shape"] == shape]
            ax.plot([r["m_or_ctx"] for r in pts], [r["ratio"] for r in pts], "o-", label=shape)
            if kern == "int4_w4a16" and any(r["gemlite_ratio"] for r in pts):
                ax.plot([r["m_or_ctx"] for r in pts], [r["gemlite_ratio"] or 0 for r in pts],
                        "x--", label=f"{shape} vs GemLite")  # fmt: skip
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context" if kern.startswith("decode") else "M (tokens)")
        ax.set_ylabel("contender time / ours (> 1: ours faster)")
        ax.set_title(kern)
        ax.legend(fontsize=6)
    fig.suptitle(f"{rows[0]['device']}: ours vs cuBLAS BF16 / GemLite / BF16-cache kernel")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    args = ap.parse_args()
    if args.smoke:  # before the first triton import
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this comparison runs on a GPU (or --smoke)")
    spec = SMOKE if args.smoke else FULL
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    # The interpreter has no bf16 math: fp32 activations and an fp16 cache stand in on CPU.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    half = torch.bfloat16 if device == "cuda" else torch.float16
    gen, bench, t0, rows = (
        torch.Generator().manual_seed(0),
        kernel_timer(device, warmup=10, rep=40),
        time.time(),
        [],
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_roofline.json")
    parts = [(int4_rows, spec["int4"], dtype), (fp8_rows, spec["fp8"], dtype)]
    parts.append((lambda *a: attention_rows(*a, half), spec["attn"], dtype))
    for fn, part_spec, act_dtype in parts:
        rows += fn(part_spec, device, name, bench, gen, act_dtype)
        for r in rows[-3:]:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()},
                  flush=True)  # fmt: skip
        with open(path, "w") as f:  # as it goes: a stage cut short keeps what ran
            json.dump(dict(device=name, wall_s=time.time() - t0, rows=rows), f, indent=1)
    plot(rows, os.path.join(args.out, "gpu_roofline.png"))
    print(f"{len(rows)} rows in {time.time() - t0:.0f} s -> {path}")


if __name__ == "__main__":
    main()
