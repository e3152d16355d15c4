"""Compile every Triton kernel for a CUDA target on a machine without a GPU.

    python tests/kernels/gpu_compile.py [sm ...]     # default: 90 (H100/H200) and 80

Runs each host wrapper on small CPU tensors with the kernel launch replaced by a recorder,
then compiles the recorded launch (types, constexprs) through Triton's whole NVIDIA pipeline
(TTIR -> TTGIR -> LLVM -> PTX -> cubin with the bundled ptxas). This catches what the
interpreter cannot: unsupported ops or dtypes, layout/shape errors in tl.dot, API drift
between Triton versions, and register spills (cuobjdump's resource usage must show no stack).
Must run without TRITON_INTERPRET (jit must build JITFunctions).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "unset TRITON_INTERPRET"

import importlib  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

# The Triton modules (slimserve_kernels.int4_gemm is the dispatch function).
(
    attn_common,
    act_quant,
    fp8_gemm,
    w8a8,
    fused_moe,
    int4_gemm,
    int4_kn,
    kv_write,
    paged_decode,
    paged_prefill,
) = (
    importlib.import_module(f"slimserve_kernels.{m}")
    for m in (
        "attn_common",
        "fp8_act_quant_triton",
        "fp8_gemm_triton",
        "fp8_w8a8_triton",
        "fused_moe_triton",
        "int4_gemm_triton",
        "int4_kn_triton",
        "kv_write_triton",
        "paged_decode",
        "paged_prefill",
    )
)
from slimserve_kernels.int4_layout import Int4KN  # noqa: E402
from slimserve_kernels.moe_common import MoEWeights  # noqa: E402

FP8 = torch.float8_e4m3fn
TYPES = {
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    FP8: "fp8e4nv",
}


class Recorder:
    """Stands in for `_kernel`: `_kernel[grid](*args, **constexprs)` is recorded, not run."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _arg_type(a) -> str:
    if isinstance(a, torch.Tensor):
        return "*" + TYPES[a.dtype]
    if isinstance(a, bool):
        return "i1"
    return "i32" if isinstance(a, int) else "fp32"


def compile_call(fn, args, kwargs, target) -> dict[str, int]:
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig = {n: _arg_type(a) for n, a in zip(fn.arg_names, args)}
    sig.update({n: "constexpr" for n in kwargs})
    src = ASTSource(fn, sig, constexprs=kwargs, attrs=divisibility(fn, args))
    kernel = triton.compile(src, target=target, options=options)
    assert kernel.asm.get("cubin"), f"{fn.__name__}: no cubin"
    usage = resource_usage(kernel.asm["cubin"])
    if ".e4m3.e4m3" in kernel.asm["ptx"]:  # an MMA on FP8 operands (wgmma / mma.sync)
        usage["FP8_MMA"] = 1
    return usage


def divisibility(fn, args) -> dict:
    """`tt.divisibility=16` on each pointer aligned to 16 bytes and each int divisible by 16,
    as a real launch specializes them (Triton's launcher checks the values). Without it the
    compiler may not use vectorized or asynchronous copies: an FP8 tile loop is then neither
    pipelined nor free of spills, although it is both when launched on a GPU."""
    attrs = {}
    for i, a in enumerate(args):
        aligned = a.data_ptr() % 16 == 0 if isinstance(a, torch.Tensor) else None
        if isinstance(a, int) and not isinstance(a, bool):
            aligned = a % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def resource_usage(cubin: bytes) -> dict[str, int]:
    """{"REG": registers per thread, "STACK": bytes of spill stack, ...} from cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def record(module, names, fn, *args, **kwargs) -> list:
    """Run fn(*args, **kwargs) with module's kernels replaced by recorders."""
    real = {n: getattr(module, n) for n in names}
    recorders = {n: Recorder(f) for n, f in real.items()}
    for n, r in recorders.items():
        setattr(module, n, r)
    try:
        fn(*args, **kwargs)
    finally:
        for n, f in real.items():
            setattr(module, n, f)
    return [(r.fn, a, k) for r in recorders.values() for a, k in r.calls]


def paged_inputs(cache_dtype, q_dtype, t=5):
    nb, bs, hkv, d, hq = 8, 16, 2, 128, 8
    kc = torch.zeros(nb, bs, hkv, d, dtype=cache_dtype)
    ks = torch.zeros(nb, bs, hkv, dtype=torch.int8) if cache_dtype == FP8 else None
    vs = None if ks is None else ks.clone()
    tables = torch.zeros(2, 4, dtype=torch.int32)
    lens = torch.tensor([3, 40], dtype=torch.int32)
    q = torch.zeros(t, hq, d, dtype=q_dtype)
    return q, (kc, kc.clone(), ks, vs), tables, lens


def attention_launches(cache_dtype) -> list:
    q, cache, bt, lens = paged_inputs(cache_dtype, torch.bfloat16)
    k = torch.zeros(5, 2, 128, dtype=torch.bfloat16)
    slots = torch.arange(5, dtype=torch.int64)
    out = record(kv_write, ["_kv_write_kernel"], kv_write.kv_write, k, k, *cache, slots)
    for splits in (1, 4):
        out += record(
            paged_decode,
            ["_decode_kernel", "_reduce_kernel"],
            paged_decode.paged_decode_attention,
            q[:2],
            *cache,
            bt,
            lens,
            0.1,
            num_splits=splits,
        )
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    out += record(
        paged_prefill,
        ["_prefill_kernel"],
        paged_prefill.paged_prefill_attention,
        q,
        *cache,
        bt,
        qsl,
        lens,
        0.1,
        max_query_len=3,
    )
    return out


def gemm_launches() -> list:
    out, names = [], ["_gemv_kernel", "_tiled_kernel", "_dequant_kernel"]
    for m, zeros in ((1, None), (4, True), (64, None), (512, True)):
        x = torch.zeros(m, 4096, dtype=torch.bfloat16)
        qw = torch.zeros(4096, 512, dtype=torch.int32)
        s = torch.zeros(4096, 32, dtype=torch.bfloat16)
        z = torch.zeros(4096, 32, dtype=torch.uint8) if zeros else None
        out += record(int4_gemm, names, int4_gemm.int4_gemm, x, qw, s, z, 128)
    # The M >= 1024 path: the dequant kernel (the cuBLAS matmul after it is not Triton).
    out += record(int4_gemm, names, int4_gemm.dequantize_int4, qw, s, z, 128, torch.bfloat16)
    return out


def int4_kn_launches() -> list:
    """The K-major W4A16 kernels at their default configs: GEMV at M 1 / 2 / 4 (groups 128
    and 32: one scale load per program, per word row), split-K GEMM at M 16 / 64 / 256, the
    dequant pass."""
    out, names = [], ["_int4_gemv_kernel", "_int4_splitk_kernel", "_int4_kn_dequant_kernel"]
    for m, group, zeros in ((1, 128, False), (2, 32, True), (4, 128, True), (16, 128, False),
                            (64, 32, True), (256, 128, False)):  # fmt: skip
        x = torch.zeros(m, 4096, dtype=torch.bfloat16)
        z = torch.zeros(4096, 4096 // group, dtype=torch.uint8) if zeros else None
        qw, s = torch.zeros(4096, 512, dtype=torch.int32), torch.zeros(4096, 4096 // group)
        w = Int4KN.of(qw, s.to(torch.bfloat16), z, group)
        out += record(int4_kn, names, int4_kn.int4_gemm_kn, x, w)
    out += record(int4_kn, names, int4_kn.dequantize_kn, w, torch.bfloat16)
    return out


def fp8_gemm_launches(arch: int) -> list:
    out = []
    w = torch.zeros(4096, 4096, dtype=FP8)
    s = torch.zeros(32, 32, dtype=torch.float32)
    real = fp8_gemm._fp8_operand  # below sm_89 the weight goes in as uint8 bits
    fp8_gemm._fp8_operand = lambda t: t if arch >= 89 else t.view(torch.uint8)
    try:
        for m in (1, 32, 64, 512):
            x = torch.zeros(m, 4096, dtype=torch.bfloat16)
            out += record(fp8_gemm, ["_fp8_gemm_kernel"], fp8_gemm.fp8_gemm, x, w, s, (128, 128))
        # The M >= 1024 path: the one-pass dequantization (the cuBLAS matmul is not Triton).
        names = ["_fp8_dequant_kernel"]
        for dtype in (torch.bfloat16, torch.float16):
            out += record(fp8_gemm, names, fp8_gemm.dequantize_fp8, w, s, (128, 128), dtype)
    finally:
        fp8_gemm._fp8_operand = real
    return out


def w8a8_launches(arch: int) -> list:
    """Activation quantization, then the W8A8 GEMM at the decode / small / prefill configs:
    FP8 dots from sm_89, fp16 dots on uint8 bits below (as on an A100)."""
    x = torch.zeros(512, 4096, dtype=torch.bfloat16)
    out = record(act_quant, ["_act_quant_kernel"], act_quant.quantize_fp8_token_groups, x)
    w, s = torch.zeros(4096, 4096, dtype=FP8), torch.zeros(32, 32, dtype=torch.float32)
    real = w8a8.fp8_dot_native
    w8a8.fp8_dot_native = lambda t: arch >= 89
    real_operand = w8a8._operand  # CPU tensors stand in for CUDA ones: the GPU's operand
    w8a8._operand = lambda t, native: t if native else t.view(torch.uint8)
    try:
        for m in (1, 32, 64, 512):
            a, a_s = torch.zeros(m, 4096, dtype=FP8), torch.zeros(m, 32, dtype=torch.float32)
            args = (a, a_s, w, s, (128, 128), torch.bfloat16)
            out += record(w8a8, ["_w8a8_gemm_kernel"], w8a8.fp8_block_gemm, *args)
    finally:
        w8a8.fp8_dot_native, w8a8._operand = real, real_operand
    return out


def moe_weights(kind: str, arch: int, e=8, h=256, inter=128, group=128, zeros=False):
    """Stacked experts of each kind; below sm_89 FP8 goes in as uint8 bits (as on an A100)."""
    if kind == "dense":
        return MoEWeights("dense", torch.zeros(e, 2 * inter, h, dtype=torch.bfloat16),
                          torch.zeros(e, h, inter, dtype=torch.bfloat16))  # fmt: skip
    if kind == "fp8":
        w13, w2 = torch.zeros(e, 2 * inter, h, dtype=FP8), torch.zeros(e, h, inter, dtype=FP8)
        if arch < 89:
            w13, w2 = w13.view(torch.uint8), w2.view(torch.uint8)
        s13, s2 = torch.zeros(e, 2, 2), torch.zeros(e, 2, 1)
        return MoEWeights("fp8", w13, w2, s13, s2, block=(128, 128))
    z = (lambda n, k: torch.zeros(e, n, k // group, dtype=torch.uint8)) if zeros else None
    return MoEWeights(
        "int4",
        torch.zeros(e, 2 * inter, h // 8, dtype=torch.int32),
        torch.zeros(e, h, inter // 8, dtype=torch.int32),
        torch.zeros(e, 2 * inter, h // group, dtype=torch.bfloat16),
        torch.zeros(e, h, inter // group, dtype=torch.bfloat16),
        z and z(2 * inter, h),
        z and z(h, inter),
        group=group,
    )


def fused_moe_launches(arch: int) -> list:
    """gate+up and down for each weight kind, at the decode (BLOCK_M 16) and prefill
    (BLOCK_M 64) configs: 4 tokens x top-8 and 128 tokens x top-8."""
    out = []
    kinds = (("dense", {}), ("fp8", {}), ("int4", {}), ("int4", {"group": 32, "zeros": True}))
    for kind, extra in kinds:
        w = moe_weights(kind, arch, **extra)
        for t in (4, 128):
            x = torch.zeros(t, 256, dtype=torch.bfloat16)
            ids = torch.arange(t * 8).remainder(8).view(t, 8)
            topk = torch.full((t, 8), 0.125)
            out += record(fused_moe, ["_moe_gemm_kernel"], fused_moe.fused_moe, x, topk, ids, w)
    return out


def launches(arch: int) -> list:
    """Every distinct launch; below sm_89 the FP8 cache goes in as uint8 bits."""
    real = attn_common.fp8_native
    attn_common.fp8_native = lambda t: arch >= 89
    try:
        out = attention_launches(FP8) + attention_launches(torch.bfloat16)
    finally:
        attn_common.fp8_native = real
    out += gemm_launches() + int4_kn_launches() + fp8_gemm_launches(arch) + w8a8_launches(arch)
    return out + fused_moe_launches(arch)


def main(archs: list[int]) -> None:
    for arch in archs:
        calls = launches(arch)
        target = GPUTarget("cuda", arch, 32)
        for fn, args, kwargs in calls:
            usage = compile_call(fn, args, kwargs, target)
            print(f"sm_{arch} {fn.__name__} {usage} {sorted(kwargs.items())}")
            # On the serving target (sm_90) a spill is a performance bug: pick smaller tiles.
            # (Triton 3.6 gives _dequant_kernel a 32-byte stack frame at 72 registers on sm_80:
            # not register pressure, and sm_80 is a fallback target, so it is only printed.)
            if arch >= 90:
                assert usage.get("STACK", 0) == 0 and usage.get("LOCAL", 0) == 0, (fn, usage)
    print(f"compiled {len(calls)} launches x {len(archs)} targets with triton {triton.__version__}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90, 80])
