"""Draft-model proposer: a smaller checkpoint with the same tokenizer drafts k tokens.

The draft runs through the engine's own ModelRunner over its own paged KV cache (the
engine's KV dtype, FP8 included), indexed by the sequence's block table: the same block
ids as the target's cache, so it allocates nothing of its own and a block costs the
target's bytes plus the draft's (the engine sizes the pool for both). It runs on rank 0
unsharded, so it works beside a tensor-parallel target.

After every step the draft catches up over the positions the target made final plus,
for a sequence that decodes next, its last (not yet computed) token, whose logits give
the first draft; each further draft is one more draft forward of the previous draft.
Positions past the end hold draft tokens' KV until the next catch-up rewrites them.
Greedy drafts are point masses: verification is the exact point-mass rule (verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from app.engine.block_manager import BlockManager
from app.engine.model_runner import ModelRunner
from app.engine.sequence import Sequence
from app.engine.spec.mtp import Span
from app.engine.step import execute


@dataclass(slots=True)
class _View:
    """What plan_step (app/engine/step.py) reads of a sequence, for the draft's own forward."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    spec_tokens: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner, blocks: BlockManager):
        self.runner, self.blocks = runner, blocks

    @torch.inference_mode()
    def after_step(
        self, spans: list[Span], hidden, rows, draft: list[Sequence], k: int
    ) -> dict[int, list[int]]:
        """spans: positions the step made final per sequence -> seq_id -> k drafts."""
        # Drafting reads the last token too: its slot may be in a block not yet allocated.
        wanted = {s.seq_id for s in draft if self.blocks.ensure_slots(s, s.num_tokens)}
        batch, order = [], []
        for s in spans:
            seq = s.seq
            end = seq.num_tokens if seq.seq_id in wanted else s.start + s.count
            if end > s.start:  # drafting: through the last token, whose logits give draft 1
                batch.append((_View(seq.token_ids, s.start, seq.block_table), end - s.start))
                order.append(seq)
        if not batch:
            return {}
        logits, sampled = execute(self.runner, batch)  # rows for views that reach their end
        views = {id(v): seq for (v, _), seq in zip(batch, order)}
        seqs = [views[id(v)] for v in sampled if views[id(v)].seq_id in wanted]
        rows = [i for i, v in enumerate(sampled) if views[id(v)].seq_id in wanted]
        if not rows:  # catch-up only (nothing to draft, e.g. speculation paused)
            return {}
        tokens = logits[rows].argmax(-1).tolist()
        drafts = [[t] for t in tokens]
        for j in range(1, k):
            if not all(self.blocks.ensure_slots(s, s.num_tokens + j) for s in seqs):
                break  # the pool is short: fewer drafts this time
            step = [
                (_View(s.token_ids + d, s.num_tokens - 1 + j, s.block_table), 1)
                for s, d in zip(seqs, drafts)
            ]
            tokens = execute(self.runner, step)[0].argmax(-1).tolist()
            for d, t in zip(drafts, tokens):
                d.append(t)
        return {s.seq_id: d for s, d in zip(seqs, drafts)}
