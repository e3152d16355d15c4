"""Vectorized PyTorch attention ops for CPU serving (same signatures as
slimserve_kernels/reference.py).

The reference loops over sequences, which is clear but slow for a batch of decodes; here a
decode batch gathers every sequence's blocks at once ([B, max_blocks * block_size] keys),
masks past each length and runs one batched attention. Prefill reuses the reference.

`prepare_decode` + `decode_layer`: what every layer of one decode step shares (the gathered
block rows, the length mask, the write slots) is built once per step instead of once per
layer (PagedAttention uses them when the backend has them); same results as
kv_write + paged_decode_attention. A step with a few new tokens per sequence (a speculative
verify step: 1 + k rows each) takes the same path with each sequence's queries padded to
the longest and a causal mask per query row: one batched attention instead of the
reference's loop over sequences (same results as kv_write + paged_prefill_attention).

When the C++ kernel builds (`slimserve_kernels/cpu_paged.py`; off with
SLIMSERVE_CPU_KERNELS=0), `decode_layer` attends with it instead: it reads the paged cache in
place through the block table, so no gather copy, dequantization pass or mask per layer,
and the step's context holds only the kernel's int32 inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimserve_kernels import cpu_paged
from slimserve_kernels.fp8_cpu import fp8_values
from slimserve_kernels.reference import is_fp8, kv_write, paged_prefill_attention

__all__ = [
    "DecodeContext",
    "decode_layer",
    "kv_write",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepare_decode",
]


def _gather(cache, scale, block_tables, dtype) -> torch.Tensor:
    """[B, maxb] tables -> [B, maxb * block_size, Hkv, D] dequantized."""
    return _gather_rows(cache, scale, block_tables.flatten().long(), block_tables.shape[0], dtype)


def _gather_rows(cache, scale, rows, b: int, dtype) -> torch.Tensor:
    """rows: [B * maxb] int64 block ids -> [B, maxb * block_size, Hkv, D] dequantized."""
    # index_select on a 2-D view is several times faster than advanced indexing on CPU.
    x = cache.view(cache.shape[0], -1).index_select(0, rows)
    x = x.view(b, -1, *cache.shape[2:])
    if not is_fp8(cache):
        return x if x.dtype == dtype else x.to(dtype)
    e = scale.view(scale.shape[0], -1).index_select(0, rows).view(b, -1, scale.shape[-1])
    return fp8_values(x, dtype) * torch.exp2(e.to(dtype)).unsqueeze(-1)


def paged_decode_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, sm_scale):
    """q: [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    dtype = torch.float32
    k = _gather(k_cache, k_scale, block_tables, dtype).transpose(1, 2)  # [B, Hkv, S, D]
    v = _gather(v_cache, v_scale, block_tables, dtype).transpose(1, 2)
    hkv = k.shape[1]
    pad = torch.arange(k.shape[2], device=q.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
    mask = torch.zeros(pad.shape, dtype=dtype, device=q.device).masked_fill_(pad, float("-inf"))
    # GQA without repeating K/V: the query heads sharing a KV head are its "query rows".
    out = F.scaled_dot_product_attention(
        q.to(dtype).view(b, hkv, hq // hkv, d),  # [B, Hkv, G, D]
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=sm_scale,
    )
    return out.reshape(b, hq, d).to(q.dtype)


# A step whose sequences each compute at most this many new tokens runs the batched path
# (decodes, speculative verify steps with k <= 16 proposals, short chunks); longer ones (a
# prefill) go to the reference, which does not pad every sequence to the longest query.
MAX_BATCHED_QUERY = 17
# The C++ kernel pads nothing, so it also takes prefills: up to this many new tokens per
# sequence it beat the reference's gather + einsum per sequence (64-token prompts, batch 32:
# 5.7 vs 11.7 ms per layer float32, vs 17.4 FP8); at 256 the reference's GEMMs were ahead
# for a float32 cache (8.3 vs 10.7 ms, batch 4).
KERNEL_MAX_QUERY = 128
# An FP8 cache: the kernel takes prefills of any length. It decodes FP8 in place where the
# reference gathers, dequantizes and materializes [H, Sq, Sk] scores per sequence; one
# prompt's whole prefill on one thread (docs/long_prompts.md): 200 tokens 18.4 vs 20.7 ms,
# 600 tokens 77 vs 97 ms, 1,000 tokens 132 vs 199 ms.
KERNEL_MAX_QUERY_FP8: int | None = None  # None: no limit


@dataclass(slots=True)
class KernelInputs:
    """The C++ kernel's view of a step: it reads the cache through these, per layer."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor | None  # [B + 1] int32; None: one row per sequence
    slot_mapping: torch.Tensor  # [T] int64, contiguous, < 0 = skip (the C++ kv_write's)


@dataclass(slots=True)
class DecodeContext:
    """What every layer of one decode or short-extend step shares."""

    rows: torch.Tensor | None  # [B * max_blocks] int64: the block tables, flattened
    mask: torch.Tensor | None  # [B, 1, Q, max_blocks * block_size] float32: -inf past each
    # position (rows and mask are None when the C++ kernel attends: `kernel` is set)
    # [T'] int64: the slots written (the >= 0 ones); None with the kernel until a cache its
    # kv_write does not take (16-bit) needs them (`_write`)
    slots: torch.Tensor | None
    kept: torch.Tensor | None  # [T'] int64: rows of k/v written; None = all of them
    # Q > 1 (e.g. a verify step: 1 + k rows per sequence): row t of q is padded row
    # query_rows[t] of [B * Q]; None: Q == 1, one row per sequence, no padding.
    query_rows: torch.Tensor | None = None
    q_len: int = 1  # Q, the longest query of the step
    group_mask: torch.Tensor | None = None  # mask per GQA group, built at the first layer
    kernel: KernelInputs | None = None  # set: the C++ kernel attends (rows, mask unused)


def prepare_decode(
    block_tables,
    seq_lens,
    slot_mapping,
    block_size: int,
    query_start_loc=None,
    fp8_cache: bool = False,
) -> DecodeContext | None:
    """query_start_loc None: a decode (one new token per sequence). Else [B + 1] rows of a
    step with several new tokens per sequence; None back if one is longer than
    KERNEL_MAX_QUERY (KERNEL_MAX_QUERY_FP8 for an FP8 cache) with the C++ kernel,
    MAX_BATCHED_QUERY without (the caller then uses the per-sequence reference)."""
    longest = 1 if query_start_loc is None else _longest_query(query_start_loc)
    on_cpu = block_tables.device.type == "cpu"
    if on_cpu and _kernel_takes(longest, fp8_cache) and cpu_paged.available():
        return _kernel_context(block_tables, seq_lens, slot_mapping, query_start_loc)
    if longest > MAX_BATCHED_QUERY:
        return None
    b, width = block_tables.shape[0], block_tables.shape[1] * block_size
    if query_start_loc is None:  # a decode: keys at or past the length are masked (the
        # general form below gives the same mask in ~10 more ops per step)
        pad = torch.arange(width, device=seq_lens.device).unsqueeze(0) >= seq_lens.unsqueeze(1)
        return _context(block_tables, pad.unsqueeze(1), slot_mapping, None, 1)
    lens = seq_lens.long()
    starts = query_start_loc.long()
    n_new = starts[1:] - starts[:-1]  # [B]
    q_len = longest
    seq_of_row = torch.repeat_interleave(torch.arange(b, device=lens.device), n_new)  # [T]
    j = torch.arange(seq_of_row.shape[0], device=lens.device) - starts[seq_of_row]
    query_rows = seq_of_row * q_len + j
    # Query j of sequence b sits at position lens[b] - n_new[b] + j and sees keys up to it;
    # padding queries (j >= n_new[b]) see key 0 only (their output is dropped).
    j = torch.arange(q_len, device=lens.device).unsqueeze(0)  # [1, Q]
    pos = (lens - n_new).unsqueeze(1) + j  # [B, Q]
    pos = pos.masked_fill(j >= n_new.unsqueeze(1), 0)
    key = torch.arange(width, device=lens.device)
    pad = key.view(1, 1, -1) > pos.unsqueeze(-1)  # [B, Q, S]
    return _context(block_tables, pad, slot_mapping, query_rows, q_len)


def _kernel_takes(longest: int, fp8_cache: bool) -> bool:
    limit = KERNEL_MAX_QUERY_FP8 if fp8_cache else KERNEL_MAX_QUERY
    return limit is None or longest <= limit


def _longest_query(query_start_loc) -> int:
    return int((query_start_loc[1:] - query_start_loc[:-1]).max())


def _kernel_context(block_tables, seq_lens, slot_mapping, query_start_loc) -> DecodeContext:
    """The step's context for the C++ kernel: its int32 inputs and the write slots."""
    as_i32 = lambda t: t if t.dtype == torch.int32 and t.is_contiguous() else t.int().contiguous()  # noqa: E731
    qsl = None if query_start_loc is None else as_i32(query_start_loc)
    all_slots = slot_mapping.long().contiguous()
    inputs = KernelInputs(as_i32(block_tables), as_i32(seq_lens), qsl, all_slots)
    return DecodeContext(None, None, None, None, kernel=inputs)


def _written(slot_mapping) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the slots written, the rows of k/v they take; None = all rows)."""
    if bool((slot_mapping < 0).any()):  # padding rows (kv_write's "skip" slots)
        kept = (slot_mapping >= 0).nonzero()[:, 0]
        return slot_mapping[kept], kept
    return slot_mapping, None


def _context(block_tables, pad, slot_mapping, query_rows, q_len: int) -> DecodeContext:
    """pad: [B, Q, S] bool, True = masked -> the step's DecodeContext."""
    mask = torch.zeros(pad.shape, dtype=torch.float32, device=pad.device)
    mask.masked_fill_(pad, float("-inf"))
    slots, kept = _written(slot_mapping)
    rows = block_tables.flatten().long()
    return DecodeContext(rows, mask.unsqueeze(1), slots, kept, query_rows, q_len)


def decode_layer(ctx: DecodeContext, q, k, v, k_cache, v_cache, k_scale, v_scale, sm_scale):
    """kv_write of the new k/v [T, Hkv, D], then attention of q [T, Hq, D] over each
    sequence's cache (causal within the step's new tokens) -> [T, Hq, D]."""
    kin = ctx.kernel
    if kin is not None and k_cache.dtype in _KERNEL_WRITES:
        f32 = torch.float32
        args = (k_cache, v_cache, k_scale, v_scale, kin.slot_mapping)
        cpu_paged.kv_write_cpu(_as(k, f32), _as(v, f32), *args)
    else:
        _write(ctx, k, v, k_cache, v_cache, k_scale, v_scale)
    if kin is not None:
        out = cpu_paged.paged_attention_cpu(
            _as(q, torch.float32), k_cache, v_cache, k_scale, v_scale,
            kin.block_tables, kin.seq_lens, kin.query_start_loc, sm_scale,
        )  # fmt: skip
        return _as(out, q.dtype)
    b, (hq, d) = ctx.mask.shape[0], q.shape[1:]
    keys = _gather_rows(k_cache, k_scale, ctx.rows, b, torch.float32).transpose(1, 2)
    values = _gather_rows(v_cache, v_scale, ctx.rows, b, torch.float32).transpose(1, 2)
    hkv = keys.shape[1]
    g, dtype = hq // hkv, q.dtype
    q = _as(q, torch.float32)
    if ctx.query_rows is None:  # decode: the query heads sharing a KV head are its rows
        out = F.scaled_dot_product_attention(
            q.view(b, hkv, g, d), keys, values, attn_mask=ctx.mask, scale=sm_scale
        )  # [B, Hkv, G, D]
        return _as(out.reshape(b, hq, d), dtype)
    # Several rows per sequence: pad to [B, Q], then rows (j, g) of each KV head.
    qq = ctx.q_len
    padded = q.new_zeros(b * qq, hq, d).index_copy_(0, ctx.query_rows, q)
    padded = padded.view(b, qq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, qq * g, d)
    if ctx.group_mask is None:  # [B, 1, Q * G, S]: row (j, g) has query j's mask
        m = ctx.mask  # [B, 1, Q, S]
        ctx.group_mask = m.unsqueeze(3).expand(b, 1, qq, g, m.shape[-1]).reshape(b, 1, qq * g, -1)
    out = F.scaled_dot_product_attention(
        padded, keys, values, attn_mask=ctx.group_mask, scale=sm_scale
    )  # [B, Hkv, Q * G, D]
    out = out.view(b, hkv, qq, g, d).permute(0, 2, 1, 3, 4).reshape(b * qq, hq, d)
    return _as(out.index_select(0, ctx.query_rows), dtype)


# Cache dtypes the C++ kv_write takes (16-bit caches keep index_copy_).
_KERNEL_WRITES = (torch.float32, torch.float8_e4m3fn)


def _write(ctx: DecodeContext, k, v, k_cache, v_cache, k_scale, v_scale) -> None:
    """kv_write of the step's new rows (the >= 0 slots) with torch ops."""
    if ctx.slots is None:  # the kernel's context: found once per step, at the first layer
        ctx.slots, ctx.kept = _written(ctx.kernel.slot_mapping)
    if ctx.kept is not None:
        k, v = k.index_select(0, ctx.kept), v.index_select(0, ctx.kept)
    if is_fp8(k_cache):
        kv_write(k, v, k_cache, v_cache, k_scale, v_scale, ctx.slots)
    else:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, ctx.slots, _as(k, k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, ctx.slots, _as(v, v_cache.dtype))


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype) without dispatching an op when it is already that dtype (every layer of
    every decode step calls this several times; a no-op .to() still costs a dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)
