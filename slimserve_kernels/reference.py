"""PyTorch reference implementations of every kernel in `slimserve_kernels/`.

Each function here has the same signature as its Triton twin; `slimserve_kernels/__init__.py`
dispatches to Triton on CUDA and to these on CPU. The cache layout they share is the
contract documented in `slimserve_kernels/README.md`.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Exponent floor for all-zero rows: 2**-100 is far below any real activation.
MIN_SCALE_EXP = -100


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def fp8_scale_exponent(x: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale per row of the last dim: x / 2**e fits in e4m3's +-448.

    x: [..., D] float -> e: [...] int8. A power of two makes scaling exact (it only
    shifts the exponent), so the only rounding is e4m3's own 3-bit mantissa.
    """
    amax = x.abs().amax(dim=-1).float().clamp_min(2.0**MIN_SCALE_EXP)
    # Exact ceil(log2(amax / 448)) from amax = m * 2**E, m in [0.5, 1), 448 = 0.875 * 2**9.
    # (fp32 log2 rounded amax a few ulps above 448 * 2**e down to e, breaking x / 2**e <= 448.)
    m, big_e = torch.frexp(amax)
    e = big_e - 9 + (m > 0.875).to(big_e.dtype)
    return e.clamp(MIN_SCALE_EXP, 127).to(torch.int8)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (q: [..., D] float8_e4m3fn, e: [...] int8) with x ~= q * 2**e."""
    e = fp8_scale_exponent(x)
    scaled = x.float() * torch.exp2(-e.float()).unsqueeze(-1)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), e


def dequantize_fp8(q: torch.Tensor, e: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q: [..., D] fp8, e: [...] int8 -> [..., D] dtype."""
    return (q.float() * torch.exp2(e.float()).unsqueeze(-1)).to(dtype)


def kv_write(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    k_scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8 (fp8 cache only)
    v_scale: torch.Tensor | None,
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; <0 = skip
) -> None:
    """Scatter new K/V into the paged cache in place, quantizing to FP8 if the cache is FP8."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    num_blocks, block_size = k_cache.shape[:2]
    kc = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    vc = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    if is_fp8(k_cache):
        qk, ek = quantize_fp8(k)
        qv, ev = quantize_fp8(v)
        kc[slots] = qk
        vc[slots] = qv
        k_scale.view(-1, k_scale.shape[-1])[slots] = ek
        v_scale.view(-1, v_scale.shape[-1])[slots] = ev
    else:
        kc[slots] = k.to(kc.dtype)
        vc[slots] = v.to(vc.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    scale: torch.Tensor | None,  # [num_blocks, block_size, Hkv] int8
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One sequence's first seq_len cached tokens, dequantized: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    ids = block_table[:n_blocks].long()
    x = cache[ids].flatten(0, 1)[:seq_len]
    if is_fp8(cache):
        e = scale[ids].flatten(0, 1)[:seq_len]
        return dequantize_fp8(x, e, dtype)
    return x.to(dtype)


def _attend(q, k, v, sm_scale: float, causal_offset: int | None) -> torch.Tensor:
    """q: [Sq, Hq, D], k/v: [Sk, Hkv, D] -> [Sq, Hq, D]; GQA by head repetition."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * sm_scale
    if causal_offset is not None:
        sq, sk = q.shape[0], k.shape[0]
        qpos = torch.arange(sq, device=q.device).unsqueeze(1) + causal_offset
        mask = torch.arange(sk, device=q.device).unsqueeze(0) > qpos
        scores.masked_fill_(mask.unsqueeze(0), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the current one
    sm_scale: float,
) -> torch.Tensor:
    """One query token per sequence against its whole paged context -> [B, Hq, D]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = gather_kv(k_cache, k_scale, block_tables[b], n, torch.float32)
        v = gather_kv(v_cache, v_scale, block_tables[b], n, torch.float32)
        out[b] = _attend(q[b : b + 1], k, v, sm_scale, None)[0]
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], new tokens of all sequences, concatenated
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    seq_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves.

    The new tokens' K/V are already in the cache (write-then-read), so a chunked prefill or
    a prefix-cache hit gives the same result as one full prefill.
    """
    out = torch.empty_like(q)
    for b in range(block_tables.shape[0]):
        s, e = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n = int(seq_lens[b])
        k = gather_kv(k_cache, k_scale, block_tables[b], n, torch.float32)
        v = gather_kv(v_cache, v_scale, block_tables[b], n, torch.float32)
        out[s:e] = _attend(q[s:e], k, v, sm_scale, n - (e - s))
    return out


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight: [N, K // 8] int32; nibble i of word j holds column 8j + i -> [N, K] uint8 0..15."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    nib = (qweight.unsqueeze(-1) >> shifts) & 0xF
    return nib.flatten(-2).to(torch.uint8)


def int4_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    qweight: torch.Tensor,  # [N, K // 8] int32
    scales: torch.Tensor,  # [N, K // group_size]
    zeros: torch.Tensor | None,  # [N, K // group_size] in the integer domain; None = 8
    group_size: int,
) -> torch.Tensor:
    """y = x @ W.T with W[n, k] = (q[n, k] - z[n, k // g]) * s[n, k // g] -> [M, N]."""
    q = unpack_int4(qweight).float()
    z = zeros.float() if zeros is not None else torch.full_like(scales, 8.0, dtype=torch.float32)
    w = (q - z.repeat_interleave(group_size, dim=1)) * scales.float().repeat_interleave(
        group_size, dim=1
    )
    return (x.float() @ w.T).to(x.dtype)


def dequantize_fp8_blocks(
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W[n, k] = weight[n, k] * scale[n // bn, k // bk] -> [N, K] dtype."""
    n, k = weight.shape
    s = scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (weight.float() * s).to(dtype)


def fp8_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk): 128x128 blocks, (1, K) per channel, (1, 128) rows
) -> torch.Tensor:
    """y = x @ W.T with W the block-scaled FP8 weight, in fp32, -> [M, N] x.dtype."""
    return (x.float() @ dequantize_fp8_blocks(weight, scale, block).T).to(x.dtype)


FP8_GROUP = 128  # activation columns per scale (DeepSeek-V3 / Kimi K2 FP8 block checkpoints)
FP8_AMAX_EPS = 1e-10  # an all-zero group gets a tiny scale instead of 0 (no 0 / 0)


def quantize_fp8_token_groups(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    group: int = FP8_GROUP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group FP8: (q [M, K] float8_e4m3fn, s [M, ceil(K / group)] float32) with
    x ~= q * s per (row, group of `group` columns); s = amax / 448, the last group may be
    partial. The scale is not a power of two (as DeepSeek-V3's `act_quant`): x / s rounds
    once more than x * 2**-e would, but uses the whole e4m3 range."""
    m, k = x.shape
    pad = -k % group
    xg = torch.nn.functional.pad(x.float(), (0, pad)).view(m, -1, group)  # [M, G, group]
    amax = xg.abs().amax(-1).clamp_min(FP8_AMAX_EPS)  # [M, G]
    # Divided by a tensor, not the Python number: on CUDA, torch computes `t / scalar` as
    # t * (1 / scalar), one rounding more than IEEE division (an H100 run: scales 1 ulp off
    # the Triton kernel's div_rn); tensor / tensor divides with IEEE rounding everywhere.
    s = amax / torch.full_like(amax, FP8_MAX)
    q = (xg / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).view(m, -1)[:, :k]
    return q.to(FP8_DTYPE), s


def fp8_block_gemm(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, ceil(K / group)] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
    out_dtype: torch.dtype,
    group: int = FP8_GROUP,
) -> torch.Tensor:
    """W8A8: both operands dequantized with their scales (a row's group scale is a (1, group)
    block), one fp32 matmul -> [M, N] out_dtype."""
    x = dequantize_fp8_blocks(a, a_scale, (1, group))
    return (x @ dequantize_fp8_blocks(weight, scale, block).T).to(out_dtype)


def fp8_w8a8_gemm(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] float32
    block: tuple[int, int],  # (bn, bk)
) -> torch.Tensor:
    """y = x @ W.T with x quantized per token group to FP8 first (W8A8) -> [M, N] x.dtype."""
    q, s = quantize_fp8_token_groups(x)
    return fp8_block_gemm(q, s, weight, scale, block, x.dtype)


def fused_moe(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k] float32 routing weights
    topk_ids: torch.Tensor,  # [T, k] int64 local expert ids (outside [0, E): other ranks')
    w,  # slimserve_kernels.moe_common.MoEWeights
) -> torch.Tensor:
    """The per-expert loop, in fp32: for each (token, expert) pair,
    out[t] += weight * down_e(silu(gate_e(x[t])) * up_e(x[t])) -> [T, H] x.dtype."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    i = w.intermediate
    for e in range(w.num_experts):
        t, j = (topk_ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        idx = torch.tensor([e], device=x.device)
        w13, w2 = w.dense(idx, "13", torch.float32)[0], w.dense(idx, "2", torch.float32)[0]
        h = x[t].float() @ w13.T
        y = (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ w2.T
        out.index_add_(0, t, y * topk_weights[t, j].float().unsqueeze(1))
    return out.to(x.dtype)
