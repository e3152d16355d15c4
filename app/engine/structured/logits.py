"""Applying the batch's grammar masks to [B, V] logits before sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from app.engine.structured.backend import xgrammar
from app.engine.structured.matcher import SequenceGrammar


def grammar_bitmask(grammars: Sequence[SequenceGrammar | None], vocab_size: int):
    """-> (bitmask [B, ceil(V / 32)] int32 on the CPU, rows that have a grammar).

    Rows without a grammar keep all bits set. None when no row has a grammar.
    """
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None, rows
    bitmask = xgrammar().allocate_token_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammars[i].fill_bitmask(bitmask, i)
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits: [B, V] float (modified in place); tokens whose bit is 0 get -inf in `rows`."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgrammar().apply_token_bitmask_inplace(
        logits, bitmask, vocab_size=logits.shape[-1], indices=rows
    )


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 bits -> [B, V] bool allowed (a reference for tests and samplers that take
    a boolean mask)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, grammars: Sequence[SequenceGrammar | None]) -> None:
    """Masks every grammar row of logits [B, V] in place (one bitmask copy per step)."""
    bitmask, rows = grammar_bitmask(grammars, logits.shape[-1])
    if bitmask is not None:
        apply_bitmask(logits, bitmask, rows)


def speculative_bitmask(seqs: Sequence, vocab_size: int):
    """-> (bitmask [R, ceil(V / 32)], grammar rows) where each sequence has 1 + k rows (its k
    proposals, `seq.spec_tokens`, then the bonus row).

    Row j of a constrained sequence is its grammar's mask after proposals 0..j-1: the
    matcher accepts them tentatively and rolls them back. Rows after a proposal the grammar
    rejects (or after one that ends it) repeat the last mask; verification rejects that
    proposal anyway, since the target's row cannot pick a masked token.
    """
    num_rows = sum(1 + len(s.spec_tokens) for s in seqs)
    bitmask = xgrammar().allocate_token_bitmask(num_rows, vocab_size)
    rows, r = [], 0
    for seq in seqs:
        k = len(seq.spec_tokens)
        if seq.grammar is not None:
            rows += range(r, r + k + 1)
            _fill_speculative(seq.grammar, seq.spec_tokens, bitmask, r)
        r += k + 1
    return bitmask, rows


def _fill_speculative(grammar: SequenceGrammar, proposals, bitmask, first: int) -> None:
    grammar.fill_bitmask(bitmask, first)
    accepted = 0
    for j, token in enumerate(proposals, start=1):
        if grammar.terminated or not grammar.accept(token):
            bitmask[first + j : first + len(proposals) + 1] = bitmask[first + j - 1]
            break
        accepted += 1
        if grammar.terminated:
            bitmask[first + j : first + len(proposals) + 1] = bitmask[first + j - 1]
            break
        grammar.fill_bitmask(bitmask, first + j)
    grammar.rollback(accepted)
