"""W4A16 on the K-major layout (`int4_layout.Int4KN`): y[M, N] = x[M, K] @ W.T.

Three paths (`choose_config`; a tuned table per GPU first, `tuned.py`, else a fixed rule):
- GEMV (M <= 4), "reverse split-K": program (n tile, k slice) owns BLOCK_N output columns and
  CHUNKS x BLOCK_K rows of K. It loads each packed word row [BK/8, BN] once (contiguous along
  N; `evict_first`: each weight byte is read once), unpacks it in registers to [BK/8, 8, BN],
  dequantizes with one FMA (`q * s + zs`, zero points pre-multiplied), multiplies by the
  activation rows on the CUDA cores and reduces with `tl.sum` (no `tl.dot`, which would pad M
  to 16). When the slice lies inside one quantization group its scales are loaded once for
  all chunks. Each program adds its [M, BN] partial into a zeroed fp32 output with a relaxed
  `tl.atomic_add`; activations are loaded `evict_last` (every n tile reads them again).
- Split-K GEMM (4 < M < DEQUANT_MIN_M): [BM, BN] tiles over a GROUP_M-swizzled 1-D grid,
  `tl.dot` on the dequantized [BK, BN] tile (BK divides the group: one scale row per K
  tile), K split across programs when the tiles alone cannot fill the GPU, partials added
  atomically as in the GEMV.
- Dequant (M >= DEQUANT_MIN_M): W.T written once in x's dtype, then cuBLAS.
With split K the sum order varies between runs (atomics): results agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from slimserve_kernels.device import DEQUANT_MIN_M, num_sms
from slimserve_kernels.gemm_common import split_k, swizzled_tile
from slimserve_kernels.int4_layout import Int4KN
from slimserve_kernels.tuned import device_name, lookup, m_bucket

TABLE = "int4_kn"  # slimserve_kernels/configs/int4_kn/<GPU>.json, bench/int4_gemv_sweep.py
GEMV_MAX_M = 4
GEMM_BUCKETS = (8, 16, 32, 64, 128, 256, 512, DEQUANT_MIN_M - 1)


@triton.jit
def _scales(s_ptr, zs_ptr, g, offs_n, mask, stride_sk, HAS_ZS: tl.constexpr):
    """(s, zs) fp32 at group rows g (a scalar, or [R, 1]) and columns offs_n; zs = -8 s when
    symmetric. Masked entries are 0."""
    s = tl.load(s_ptr + g * stride_sk + offs_n, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZS:  # noqa: SIM108 (a compile-time branch: no load when symmetric)
        zs = tl.load(zs_ptr + g * stride_sk + offs_n, mask=mask, other=0.0)
    else:
        zs = s * -8.0
    return s, zs


@triton.jit
def _load_words(w_ptr, rows, offs_n, KW, N, stride_wk):
    """Packed word rows [R, BN] (0 outside W), streamed: each is read once per launch."""
    mask = (rows < KW)[:, None] & (offs_n < N)[None, :]
    ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wk + offs_n[None, :]
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first")


@triton.jit
def _dequant(words, s, zs):
    """words [R, BN] -> W.T rows [R, 8, BN] fp32, element [j, i, n] = W[n, 8 * row_j + i];
    s, zs broadcast to [R or 1, 1, BN]."""
    q = (words[:, None, :] >> (tl.arange(0, 8) * 4)[None, :, None]) & 0xF
    return q.to(tl.float32) * s + zs


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    zs_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wk,
    stride_sk,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_ZS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr,
    SCALES: tl.constexpr,  # 0: one load per program, 1: per chunk, 2: per word row
    ATOMIC: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, BLOCK_K // 8)
    k_start = tl.program_id(1) * (BLOCK_K * CHUNKS)
    s, zs = _scales(s_ptr, zs_ptr, k_start // GROUP, offs_n, nmask, stride_sk, HAS_ZS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in tl.static_range(CHUNKS):
        k0 = k_start + c * BLOCK_K
        rows = k0 // 8 + offs_j  # [BK/8] word rows
        words = _load_words(w_ptr, rows, offs_n, K // 8, N, stride_wk)
        if SCALES == 2:
            gmask = (rows < K // 8)[:, None] & nmask[None, :]
            g = ((rows * 8) // GROUP)[:, None]
            s2, zs2 = _scales(s_ptr, zs_ptr, g, offs_n[None, :], gmask, stride_sk, HAS_ZS)
            w = _dequant(words, s2[:, None, :], zs2[:, None, :])
        else:
            if SCALES == 1 and c > 0:
                gmask = offs_n < tl.where(k0 < K, N, 0)  # a chunk past K loads nothing
                s, zs = _scales(s_ptr, zs_ptr, k0 // GROUP, offs_n, gmask, stride_sk, HAS_ZS)
            w = _dequant(words, s[None, None, :], zs[None, None, :])  # [BK/8, 8, BN]
        cols = (rows * 8)[:, None] + tl.arange(0, 8)[None, :]  # [BK/8, 8]: K index
        for m in tl.static_range(BLOCK_M):
            k_lim = tl.where(m < M, K, 0)  # rows past M (BLOCK_M padding) read nothing
            xm = tl.load(x_ptr + m * stride_xm + cols, mask=cols < k_lim, other=0.0,
                         eviction_policy="evict_last").to(tl.float32)  # fmt: skip
            part = tl.sum(tl.sum(w * xm[:, :, None], axis=0), axis=0)  # [BN]
            acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ymask = (offs_m < M)[:, None] & nmask[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=ymask, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _int4_splitk_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    zs_ptr,
    y_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wk,
    stride_sk,
    stride_ym,
    GROUP: tl.constexpr,
    HAS_ZS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ATOMIC: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m, offs_n = swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mmask, nmask = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo = tl.program_id(1) * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xmask = mmask[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=xmask, other=0.0, eviction_policy="evict_last")
        words = _load_words(w_ptr, k0 // 8 + tl.arange(0, BLOCK_K // 8), offs_n, K // 8, N,
                            stride_wk)  # fmt: skip
        s, zs = _scales(s_ptr, zs_ptr, k0 // GROUP, offs_n, nmask, stride_sk, HAS_ZS)
        w = tl.reshape(_dequant(words, s[None, None, :], zs[None, None, :]), [BLOCK_K, BLOCK_N])
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    ymask = mmask[:, None] & nmask[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=ymask, sem="relaxed")
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _int4_kn_dequant_kernel(
    w_ptr,
    s_ptr,
    zs_ptr,
    out_ptr,
    N,
    K,
    stride_wk,
    stride_sk,
    stride_ok,
    GROUP: tl.constexpr,
    HAS_ZS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < K // 8)[:, None] & (offs_n < N)[None, :]
    words = _load_words(w_ptr, rows, offs_n, K // 8, N, stride_wk)
    g = ((rows * 8) // GROUP)[:, None]
    s, zs = _scales(s_ptr, zs_ptr, g, offs_n[None, :], mask, stride_sk, HAS_ZS)
    w = _dequant(words, s[:, None, :], zs[:, None, :])  # [BK/8, 8, BN]
    ks = (rows * 8).to(tl.int64)[:, None, None] + tl.arange(0, 8)[None, :, None]
    o_ptrs = out_ptr + ks * stride_ok + offs_n[None, None, :]
    tl.store(o_ptrs, w.to(out_ptr.dtype.element_ty), mask=mask[:, None, :])


def dequantize_kn(w: Int4KN, dtype: torch.dtype) -> torch.Tensor:
    """W.T [K, N] in dtype, one pass (the dequant-then-cuBLAS path)."""
    n, k = w.shape
    out = torch.empty(k, n, device=w.qweight_t.device, dtype=dtype)
    zs = w.zs_t if w.zs_t is not None else w.scales_t
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 64))
    _int4_kn_dequant_kernel[grid](w.qweight_t, w.scales_t, zs, out, n, k, w.qweight_t.stride(0),
                                  w.scales_t.stride(0), out.stride(0), GROUP=w.group_size,
                                  HAS_ZS=w.zs_t is not None, BLOCK_N=64, BLOCK_K=64)  # fmt: skip
    return out


def table_key(m: int, n: int, k: int, group: int) -> tuple[int, int, int, int]:
    """The tuned table's key: (M bucket, N, K, group); M itself for the GEMV."""
    return (m if m <= GEMV_MAX_M else m_bucket(m, GEMM_BUCKETS), n, k, group)


def choose_config(m: int, n: int, k: int, group: int, device: str = "cpu", sms: int = 132) -> dict:
    """The tuned config for this GPU and shape, else the fixed rule (what CPU tests run)."""
    if m >= DEQUANT_MIN_M:
        return dict(path="dequant")
    tuned = lookup(TABLE, device, table_key(m, n, k, group))
    if tuned is not None:
        return tuned
    if m <= GEMV_MAX_M:
        bm = triton.next_power_of_2(m)
        bk = 64 if bm <= 2 else 32
        # A slice of up to one group (128 K) per program: one scale load for its chunks.
        chunks = max(1, min(group, 128) // bk)
        return dict(path="gemv", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk, CHUNKS=chunks, num_warps=4)
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    cfg = dict(path="splitk", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=min(64, group), num_warps=4)
    if bm == 128:
        cfg.update(BLOCK_N=128, BLOCK_K=32, num_warps=8)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, cfg["BLOCK_N"])
    cfg["split_k"] = split_k(tiles, triton.cdiv(k, cfg["BLOCK_K"]), sms)
    return cfg


def _scale_mode(span: int, block_k: int, group: int) -> int:
    """0: a program's K slice lies in one group; 1: each chunk does; 2: neither."""
    return 0 if span <= group else 1 if block_k <= group else 2


def int4_gemm_kn(x: torch.Tensor, w: Int4KN, config: dict | None = None) -> torch.Tensor:
    """Triton twin of `int4_layout.int4_gemm_kn`; `config` overrides `choose_config`."""
    m, k = x.shape
    n, kw = w.shape
    g = w.group_size
    assert kw == k and x.dtype in (torch.float16, torch.bfloat16, torch.float32), (x.shape, x.dtype)
    assert g in (32, 64, 128) and x.stride(1) == 1, (g, x.stride())
    cfg = config or choose_config(m, n, k, g, device_name(x), num_sms(x))
    if cfg["path"] == "dequant":
        return torch.matmul(x, dequantize_kn(w, x.dtype))
    bk = cfg["BLOCK_K"]
    assert bk % 8 == 0 and (bk & (bk - 1)) == 0, bk
    zs = w.zs_t if w.zs_t is not None else w.scales_t  # unused when symmetric
    meta = dict(GROUP=g, HAS_ZS=w.zs_t is not None, BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, num_warps=cfg.get("num_warps", 4))  # fmt: skip
    if cfg["path"] == "gemv":
        assert m <= cfg["BLOCK_M"] <= 16, (m, cfg)
        span = bk * cfg["CHUNKS"]
        k_progs = triton.cdiv(k, span)
        meta.update(CHUNKS=cfg["CHUNKS"], SCALES=_scale_mode(span, bk, g), ATOMIC=k_progs > 1)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), k_progs)
    else:
        assert g % bk == 0 and bk >= 16, (g, bk)  # one scale row per K tile
        splits = cfg["split_k"]
        k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        meta.update(GROUP_M=cfg.get("GROUP_M", 8), ATOMIC=splits > 1, PRECISION=prec)
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), splits)
    atomic = meta["ATOMIC"]
    y = torch.zeros(m, n, device=x.device, dtype=torch.float32) if atomic else x.new_empty(m, n)
    args = [x, w.qweight_t, w.scales_t, zs, y, m, n, k]
    if cfg["path"] == "gemv":
        _int4_gemv_kernel[grid](*args, x.stride(0), w.qweight_t.stride(0), w.scales_t.stride(0),
                                y.stride(0), **meta)  # fmt: skip
    else:
        _int4_splitk_kernel[grid](*args, k_per_split, x.stride(0), w.qweight_t.stride(0),
                                  w.scales_t.stride(0), y.stride(0), **meta)  # fmt: skip
    return y.to(x.dtype) if atomic else y
