"""Fused MoE: two grouped GEMMs over (token, expert) rows sorted by expert and padded per
expert to BLOCK_M (moe_common.py `align_rows`), so each M tile belongs to one expert.

The padded layout has a fixed size for given shapes (`align_rows`: no host sync), so a decode
step through these kernels can be recorded as a CUDA graph; tiles past the last expert's
slice are marked -1 and skip their work.

1. gate+up: `inter[slot] = silu(x[t] @ W_gate[e].T) * (x[t] @ W_up[e].T)`, both halves of
   `w13[e]` in one program (two accumulators), SiLU-and-mul fused before the store.
2. down:    `out_rows[r] = weight[r] * (inter[slot] @ W2[e].T)` in fp32, at the pair's row.
3. combine: `out[t] = sum_j out_rows[t * k + j]` (a sum over a view; deterministic).

Expert weights: dense (fp16/bf16/fp32), FP8 e4m3 with block scales (dequantized in the
tile, the scale applied to the fp32 partial product per K tile as in fp8_gemm_triton.py), or INT4
(slimserve_kernels/README.md packing, groups 32/64/128, unpacked in registers by int4_gemm's
`_unpack_words`). One launch per projection whatever the number of active experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.device import fp8_tensor_cores
from slimserve_kernels.fp8_utils import e4m3_bits_to_fp16
from slimserve_kernels.int4_gemm_triton import _unpack_words
from slimserve_kernels.moe_common import MoEWeights, align_rows

KINDS = {"dense": 0, "fp8": 1, "int4": 2}


@triton.jit
def _w_tile(w_ptr, s_ptr, z_ptr, offs_n, k0, n_rows, K, swn, ssn, szn,
            KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Rows offs_n [BN] x columns k0..k0+BK of one expert's weight -> [BN, BK] (0 outside)."""
    if KIND == 2:
        words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        weight, strides = (w_ptr, s_ptr, z_ptr), (swn, ssn, szn)
        w = _unpack_words(weight, strides, offs_n, words_k, n_rows, K, GROUP, HAS_ZEROS)
        w = tl.reshape(w, [BLOCK_N, BLOCK_K])
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_n < n_rows)[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * swn + offs_k[None, :], mask=mask)
        if w_ptr.dtype.element_ty == tl.uint8:  # e4m3 bits (GPUs without native fp8)
            w = e4m3_bits_to_fp16(w)
    return w


@triton.jit
def _w_scale(s_ptr, offs_n, k0, n_rows, ssn, KIND: tl.constexpr, SBN: tl.constexpr,
             SBK: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """FP8: the block scale of rows offs_n at K tile k0 [BN]; other kinds: ones."""
    if KIND == 1:
        ptrs = s_ptr + (offs_n // SBN).to(tl.int64) * ssn + k0 // SBK
        return tl.load(ptrs, mask=offs_n < n_rows, other=0.0).to(tl.float32)
    return tl.full([BLOCK_N], 1.0, tl.float32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, tile_expert_ptr, topk_w_ptr,
    N, K, n_rows, num_pairs, stride_am, swe, swn, sse, ssn, sze, szn, stride_om,
    TOP_K: tl.constexpr, GATE_UP: tl.constexpr, KIND: tl.constexpr, HAS_ZEROS: tl.constexpr,
    GROUP: tl.constexpr, SBN: tl.constexpr, SBK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    tile_expert = tl.load(tile_expert_ptr + pid_m)
    # An unused tile (-1: past the last expert's slice; the grid is static, align_rows) runs
    # no K loop and stores nothing (its rows are all the sentinel).
    k_end = tl.where(tile_expert < 0, 0, K)
    e = tl.maximum(tile_expert, 0).to(tl.int64)
    slots = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(rows_ptr + slots)  # [BM] pair r = t * TOP_K + j; num_pairs = padding
    valid = rows < num_pairs
    # gate+up reads x[token]; down reads the intermediate at the pair's padded slot.
    a_rows = (rows // TOP_K if GATE_UP else slots).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e, s_e, z_e = w_ptr + e * swe, s_ptr + e * sse, z_ptr + e * sze
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        amask = valid[:, None] & (offs_k < K)[None, :]
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=amask, other=0.0)
        w = _w_tile(w_e, s_e, z_e, offs_n, k0, n_rows, K, swn, ssn, szn,
                    KIND, HAS_ZEROS, GROUP, BLOCK_N, BLOCK_K)  # fmt: skip
        sc = _w_scale(s_e, offs_n, k0, n_rows, ssn, KIND, SBN, SBK, BLOCK_N)
        acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PRECISION) * sc[None, :]
        if GATE_UP:  # the up rows sit N rows below the gate rows of w13
            w = _w_tile(w_e, s_e, z_e, offs_n + N, k0, n_rows, K, swn, ssn, szn,
                        KIND, HAS_ZEROS, GROUP, BLOCK_N, BLOCK_K)  # fmt: skip
            sc = _w_scale(s_e, offs_n + N, k0, n_rows, ssn, KIND, SBN, SBK, BLOCK_N)
            acc_up += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PRECISION) * sc[None, :]
    if GATE_UP:
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the loop rounds
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        res = gate * tl.sigmoid(gate) * up
        o_rows = slots.to(tl.int64)
    else:
        res = acc * tl.load(topk_w_ptr + rows, mask=valid, other=0.0)[:, None]
        o_rows = rows.to(tl.int64)
    omask = valid[:, None] & (offs_n < N)[None, :]
    res = res.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + o_rows[:, None] * stride_om + offs_n[None, :], res, mask=omask)


def choose_config(num_pairs: int) -> dict:
    """A fixed table (CPU tests run the GPU's configs); BLOCK_M is the per-expert padding.
    8 warps: with 4 the gate+up program (two accumulators, two weight tiles) spilled on
    sm_90 for every weight kind (tests/kernels/gpu_compile.py); BLOCK_N 32 at BLOCK_M 64
    keeps FP8 gate+up at 220 registers with no stack (BLOCK_N 64 spilled 224 bytes)."""
    if num_pairs <= 512:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=8)
    return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, num_warps=8)


def _weight_args(w: MoEWeights, which: str) -> tuple:
    t, s, z = (w.w13, w.s13, w.z13) if which == "13" else (w.w2, w.s2, w.z2)
    if w.kind == "fp8" and t.is_cuda and not fp8_tensor_cores(t.device):
        t = t.view(torch.uint8)
    s = s if s is not None else t  # unused pointers for kinds without them
    zz = z if z is not None else s
    return (
        t,
        s,
        zz,
        (t.stride(0), t.stride(1), s.stride(0), s.stride(1), zz.stride(0), zz.stride(1)),
    )


def _launch(a, w, which, out, rows, tiles, topk_w, n, k, num_pairs, top_k, cfg):
    t, s, z, strides = _weight_args(w, which)
    grid = (tiles.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, t, s, z, out, rows, tiles, topk_w, n, k, t.shape[1], num_pairs, a.stride(0),
        *strides, out.stride(0), TOP_K=top_k, GATE_UP=which == "13", KIND=KINDS[w.kind],
        HAS_ZEROS=w.z13 is not None, GROUP=w.group, SBN=w.block_of(which)[0],
        SBK=w.block_of(which)[1],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"],
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [T, H] fp16/bf16/fp32
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int64 local expert ids (outside [0, E): skipped)
    w: MoEWeights,
    config: dict | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fused_moe` -> [T, H] x.dtype."""
    tkn, h = x.shape
    top_k, inter = topk_ids.shape[1], w.intermediate
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.stride(1) == 1
    assert w.kind in KINDS and w.w13.shape[0] == w.w2.shape[0]
    assert w.kind != "int4" or w.group in (32, 64, 128), w.group
    cfg = config or choose_config(topk_ids.numel())
    if w.kind == "fp8":
        for which, k in (("13", h), ("2", inter)):
            bk = w.block_of(which)[1]
            assert bk % cfg["BLOCK_K"] == 0 or bk >= k, "a K tile may not straddle a scale block"
    rows, tiles = align_rows(topk_ids, w.num_experts, cfg["BLOCK_M"])
    pairs = topk_ids.numel()
    if rows.numel() == 0:
        return torch.zeros_like(x)
    weights = topk_weights.float().contiguous()
    inter_buf = torch.empty(rows.numel(), inter, device=x.device, dtype=x.dtype)
    _launch(x, w, "13", inter_buf, rows, tiles, weights, inter, h, pairs, top_k, cfg)
    out_rows = torch.zeros(pairs, h, device=x.device, dtype=torch.float32)
    _launch(inter_buf, w, "2", out_rows, rows, tiles, weights, h, inter, pairs, top_k, cfg)
    return out_rows.view(tkn, top_k, h).sum(1).to(x.dtype)
