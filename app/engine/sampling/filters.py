"""Top-k / top-p / min-p over sorted candidates, in log space, as [R, K] tensor ops.

Semantics (as Hugging Face and vLLM): temperature first; top-k keeps the k most likely tokens
(ties with the k-th kept); top-p keeps the smallest prefix, in descending order, of the
top-k-renormalized distribution whose mass reaches top_p; min-p keeps tokens with
p >= min_p * p_max. The most likely token is always kept, so top_p = 1e-300 or min_p = 1 never
leave a row empty.

Candidates: on CPU a full sort of a 160k vocabulary costs ~10-40 ms a row, so each filtered
row is first cut to its K most likely tokens (`torch.topk`, K = 256, then 4096); `covered` says
whether the row's kept set provably lies inside them, and the rows that are not are redone with
the next K, the last being the whole vocabulary.
On CUDA the whole vocabulary is sorted at once (cheap there, and no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_CANDIDATES = (256, 4096)  # top-k sizes tried before a full sort


@dataclass(slots=True)
class RowFilters:
    """The filter parameters of R rows."""

    top_k: torch.Tensor  # [R] int64; 0 = off
    top_p: torch.Tensor  # [R] float32
    min_p: torch.Tensor  # [R] float32
    # False: no row has top-k (min-p); its ops are skipped (they would keep everything). A
    # batch's flags hold for any subset of its rows. Each skipped op costs a dispatch per step.
    any_top_k: bool = True
    any_min_p: bool = True

    def subset(self, rows: torch.Tensor) -> RowFilters:
        return RowFilters(
            self.top_k[rows], self.top_p[rows], self.min_p[rows], self.any_top_k, self.any_min_p
        )


def candidates(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logp: [R, V] -> (values [R, K], token ids [R, K]) in descending order."""
    if k >= logp.shape[-1]:
        return logp.sort(-1, descending=True)
    return logp.topk(k, -1)


def keep_mask(v: torch.Tensor, f: RowFilters) -> torch.Tensor:
    """v: [R, K] descending log-probabilities (normalized over the whole vocabulary) -> [R, K]
    bool: which candidates survive the filters (exact when `covered` holds, or K = V)."""
    if f.any_top_k:
        keep, p = _top_k(v, f)
    else:  # what _top_k gives with every row off: all kept, p = exp(v - 0.0) = exp(v)
        keep, p = torch.ones_like(v, dtype=torch.bool), v.exp()
    before = p.cumsum(-1) - p  # mass strictly above each candidate
    keep &= (before < f.top_p[:, None]) | (f.top_p >= 1.0)[:, None]  # 1.0: off, not rounding
    if f.any_min_p:
        keep &= v >= v[:, :1] + f.min_p[:, None].log()  # log(0) = -inf keeps all
    keep[:, 0] = True
    return keep


def _top_k(v: torch.Tensor, f: RowFilters) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [R, K] -> (kept by top-k [R, K] bool, top-k-renormalized probabilities [R, K])."""
    kth = (f.top_k.clamp(1, v.shape[-1]) - 1)[:, None]  # [R, 1]
    topk_on = (f.top_k > 0)[:, None]
    keep = ~topk_on | (v >= v.gather(-1, kth))
    masked = torch.where(keep, v, float("-inf"))
    lse = torch.where(topk_on, masked.logsumexp(-1, keepdim=True), 0.0)  # top-k renormalizes
    return keep, torch.where(keep, (v - lse).exp(), 0.0)


def covered(v: torch.Tensor, f: RowFilters, vocab: int) -> torch.Tensor:
    """v: [R, K] the K most likely log-probabilities -> [R] bool: the row's kept set provably
    lies inside these K candidates (so the candidate answer equals the whole-vocabulary one)."""
    num_cand = v.shape[-1]
    if num_cand >= vocab:
        return torch.ones(v.shape[0], dtype=torch.bool, device=v.device)
    last = v[:, -1]
    before_last = v[:, :-1].exp().sum(-1)  # top-k off: v is already normalized
    inside = (f.top_p < 1.0) & (before_last >= f.top_p)  # top-p's set (where top-k is off)
    if f.any_top_k:
        kth = v.gather(-1, (f.top_k.clamp(1, num_cand) - 1)[:, None])[:, 0]
        topk_in = (f.top_k > 0) & (f.top_k < num_cand) & (kth > last)  # ties with k-th too
        inside = topk_in | ((f.top_k == 0) & inside)
    if f.any_min_p:
        inside |= last < v[:, 0] + f.min_p.log()
    return inside
