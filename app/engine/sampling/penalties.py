"""Repetition / presence / frequency penalties as [P, V] tensor ops over the penalty rows.

Pure functions of (prompt ids, output ids, logits): the output ids are every token the
sequence has, wherever it was sampled (a prefill replica's first token included), so a
disaggregated, preempted or offline run penalizes the same way.
Repetition (as Hugging Face) over prompt + output: positive logits divided, negative ones
multiplied. Presence and frequency (as OpenAI) over the output only.
"""

from __future__ import annotations

import torch

from app.engine.sampling.batch import SamplingBatch

LOGIT_LIMIT = 1e30  # penalized logits are clamped below this: finite even after / GREEDY_EPS


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] float32, modified in place and returned."""
    pen = batch.penalties
    if pen is None:
        return logits
    rows = pen.batch_rows  # [P]
    sub = logits[rows]  # [P, V] (a copy)
    num_rows, vocab = sub.shape
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=logits.device)
    counts.index_put_(
        (pen.output_rows, pen.output_ids),
        torch.ones_like(pen.output_ids, dtype=torch.float32),
        accumulate=True,
    )
    seen = counts > 0  # [P, V]
    seen[pen.prompt_rows, pen.prompt_ids] = True
    rep = batch.repetition[rows, None]  # [P, 1]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub -= (counts > 0) * batch.presence[rows, None] + counts * batch.frequency[rows, None]
    logits[rows] = sub.clamp_(max=LOGIT_LIMIT)  # -inf (a grammar mask) stays -inf
    return logits
