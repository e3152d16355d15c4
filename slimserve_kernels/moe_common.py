"""Fused MoE without Triton: the expert weight bundle, routing sort/pad, and the CPU path.

Every routed (token, expert) pair is a *row* `r = t * top_k + j` (token t's j-th expert).
Rows are sorted by expert; for the Triton kernels each expert's slice is padded to a
multiple of BLOCK_M with the sentinel `T * top_k`, so every BLOCK_M tile has one expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimserve_kernels.fp8_cpu import dequantize_fp8_cpu
from slimserve_kernels.reference import dequantize_fp8_blocks, unpack_int4


@dataclass(slots=True)
class MoEWeights:
    """One rank's experts, stacked. kind: "dense" | "fp8" | "int4".

    dense: w13 [E, 2I, H], w2 [E, H, I] (gate rows then up rows, as `gate_up_proj`).
    fp8:   the same shapes in float8_e4m3fn; s13 [E, ceil(2I/bn), ceil(H/bk)], s2 likewise
           float32, `block` = (bn, bk).
    int4:  w13 [E, 2I, H/8] int32 (slimserve_kernels/README.md packing), s13 [E, 2I, H/g],
           z13 [E, 2I, H/g] or None (symmetric, 8); w2 [E, H, I/8] ...; `group` = g.
    """

    kind: str
    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    z13: torch.Tensor | None = None
    z2: torch.Tensor | None = None
    block: tuple[int, int] = (128, 128)  # FP8 scale block of w13
    group: int = 128
    block2: tuple[int, int] | None = None  # FP8 scale block of w2 (None: `block`)

    def block_of(self, which: str) -> tuple[int, int]:
        return self.block if which == "13" or self.block2 is None else self.block2

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate(self) -> int:
        return self.w13.shape[1] // 2

    def expert(self, e: int, which: str, dtype: torch.dtype) -> torch.Tensor:
        """Expert e of w13 or w2 -> [N, K] dtype, read in place (no gather): dense in `dtype`
        is a view of the stack; FP8 / INT4 are dequantized from that expert's slices."""
        w, s, z = (self.w13, self.s13, self.z13) if which == "13" else (self.w2, self.s2, self.z2)
        if self.kind == "dense":
            return w[e].to(dtype)  # a view when the dtype matches
        if self.kind == "fp8":
            return dequantize_fp8_cpu(w[e], s[e], self.block_of(which), dtype)
        q = unpack_int4(w[e]).float()  # [N, K]
        scale = s[e].float().repeat_interleave(self.group, -1)
        zero = 8.0 if z is None else z[e].float().repeat_interleave(self.group, -1)
        return ((q - zero) * scale).to(dtype)

    def dense(self, e: torch.Tensor, which: str, dtype: torch.dtype) -> torch.Tensor:
        """Experts e [A] of w13 or w2 dequantized -> [A, N, K] dtype (gathered: what the
        reference loop uses, written apart from `expert` on purpose)."""
        w, s, z = (self.w13, self.s13, self.z13) if which == "13" else (self.w2, self.s2, self.z2)
        w = w.index_select(0, e)
        if self.kind == "dense":
            return w.to(dtype)
        if self.kind == "fp8":
            s = s.index_select(0, e)
            blk = self.block_of(which)
            return torch.stack([dequantize_fp8_blocks(a, b, blk, dtype) for a, b in zip(w, s)])
        q = unpack_int4(w).float()  # [A, N, K]
        s = s.index_select(0, e).float().repeat_interleave(self.group, -1)
        z = 8.0 if z is None else z.index_select(0, e).float().repeat_interleave(self.group, -1)
        return ((q - z) * s).to(dtype)


def sort_rows(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """ids [T, k] (local expert ids; >= num_experts or < 0: not this rank's) -> (rows of this
    rank's pairs sorted by expert [R] int64, count per expert (one host sync))."""
    flat = ids.flatten()
    local = (flat >= 0) & (flat < num_experts)
    key = torch.where(local, flat, num_experts)
    order = key.argsort(stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1).tolist()
    return order[: sum(counts[:num_experts])], counts[:num_experts]


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the BLOCK_M tiles of `align_rows`, from the shapes alone: each active
    expert pads fewer than block_m rows, and at most min(E, pairs) experts are active."""
    return -(-pairs // block_m) + min(num_experts, pairs)


def align_rows(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_rows [P] int32: this rank's pairs sorted by expert, each expert's
    slice padded to a multiple of block_m with the sentinel T*k; tile_expert [P / block_m]
    int32, the expert of each tile, -1 for the unused tiles after the last slice).

    No host sync, so a CUDA graph can record it: P = max_tiles(...) * block_m is fixed by the
    shapes (the kernels' grid is static; unused tiles do no work) and every step is a tensor
    op (no bincount, whose CUDA size is data-dependent, no .tolist())."""
    e, bm, dev = num_experts, block_m, ids.device
    flat = ids.flatten()
    pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < e), flat, e)  # e: another rank's expert
    order = key.argsort(stable=True)  # [pairs] grouped by expert, other ranks' last
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key)
    )[:e]
    padded = (counts + bm - 1) // bm * bm  # [E]
    pad_end, cnt_end = padded.cumsum(0), counts.cumsum(0)
    ex = key.index_select(0, order)  # [pairs] expert of each sorted pair
    exc = ex.clamp(max=e - 1)
    rank = torch.arange(pairs, device=dev) - (cnt_end - counts).index_select(0, exc)
    size = max_tiles(pairs, e, bm) * bm
    slot = torch.where(ex < e, (pad_end - padded).index_select(0, exc) + rank, size)
    out = torch.full((size + 1,), pairs, dtype=torch.int32, device=dev)  # + a dummy slot
    out[slot] = order.to(torch.int32)  # other ranks' pairs all land in the dummy slot
    starts = torch.arange(0, size, bm, device=dev)
    tile_expert = torch.searchsorted(pad_end, starts, right=True)  # slice holding the tile
    return out[:size], torch.where(tile_expert < e, tile_expert, -1).to(torch.int32)


def fused_moe_torch(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int64, local expert ids (others skipped)
    w: MoEWeights,
) -> torch.Tensor:
    """The CPU path over the sorted layout: tokens gathered once, then per active expert two
    matmuls on the stacked weights in place (no module calls, no weight copies for dense;
    FP8/INT4 experts dequantized one at a time), SiLU-and-mul between, one weighted
    scatter-add at the end. [T, H].

    Dense experts are used as views of the stacks (`MoEWeights.expert`): gathering them
    (index_select) copied every active expert's weights on every forward. Against the
    per-expert module loop: bench/moe_cpu.py."""
    k = topk_ids.shape[1]
    rows, counts = sort_rows(topk_ids, w.num_experts)
    out = torch.zeros_like(x)
    if rows.numel() == 0:
        return out
    xs = x.index_select(0, rows // k)  # [R, H] grouped by expert
    ys, start = torch.empty_like(xs), 0
    for e, c in enumerate(counts):
        if not c:
            continue
        gate, up = F.linear(xs[start : start + c], w.expert(e, "13", x.dtype)).chunk(2, -1)
        ys[start : start + c] = F.linear(F.silu(gate) * up, w.expert(e, "2", x.dtype))
        start += c
    ys = (ys.float() * topk_weights.flatten()[rows].unsqueeze(1)).to(x.dtype)
    return out.index_add_(0, rows // k, ys)
