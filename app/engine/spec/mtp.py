"""MTP proposer: the checkpoint's own multi-token-prediction layer drafts k tokens.

The MTP layer has its own one-layer paged KV cache, indexed by the sequence's block table
(same block ids as the main cache), so it needs no allocation of its own. It lags the main
model by one position: position i needs the main hidden state at i and token i + 1. After
every step (`after_step`) it catches up over the positions the step made final, then
drafts greedily: the first draft from its last position, each further draft by running the
layer again on its own hidden state and draft (positions past the sequence's end; their
MTP KV is rewritten by the next catch-up before anything reads it).

Greedy drafts are point masses, so verification is the exact point-mass rule (verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.attention import AttentionMetadata, PagedAttention
from app.engine.block_manager import BlockManager
from app.engine.kv_cache import KVCache
from app.engine.sequence import Sequence


@dataclass(slots=True)
class Span:
    seq: Sequence
    start: int  # first position this forward computes
    count: int  # positions computed
    block_size: int = 0  # set where slots are computed (MTP plans)


class _Shifted:
    """The MTP layer is layer L of the model but layer 0 of its own cache."""

    def __init__(self, attn: PagedAttention, first_layer: int):
        self.attn, self.first_layer = attn, first_layer

    def __call__(self, layer: int, q, k, v):
        return self.attn(layer - self.first_layer, q, k, v)


@dataclass(frozen=True, slots=True)
class MTPForward:
    """One MTP forward as plain lists (what tensor-parallel ranks receive too)."""

    positions: list[int]  # [T]
    slots: list[int]  # [T]
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B, max_blocks], zero-padded


@dataclass(frozen=True, slots=True)
class MTPPlan:
    """A step's MTP work: catch up over the positions the step made final (token i + 1 and
    the main hidden state at row `hidden_rows[i]` of the step), then draft recursively for
    the sequences whose catch-up output row is in `last_rows`."""

    catch_up: MTPForward
    ids: list[int]  # [T] tokens read by the catch-up (t[i + 1] per position i)
    hidden_rows: list[int]  # [T] rows of the step's hidden states
    last_rows: list[int]  # [B'] catch-up output row of each drafting sequence
    steps: list[MTPForward]  # drafts 2..k: one position per drafting sequence each


def _forward_of(spans: list[Span]) -> MTPForward:
    pos, slots, starts, lens = [], [], [0], []
    for s in spans:
        table, bs = s.seq.block_table, s.block_size
        pos += range(s.start, s.start + s.count)
        slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.start + s.count)]
        starts.append(starts[-1] + s.count)
        lens.append(s.start + s.count)
    width = max(len(s.seq.block_table) for s in spans)
    tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in spans]
    return MTPForward(pos, slots, starts, lens, tables)


class MTPRunner:
    """Runs an MTPPlan on this rank's shard of the MTP layer and of its one-layer cache;
    every rank of a tensor-parallel replica runs the same plan (the layer's collectives and
    the gathered logits keep them in step), so every rank computes the same drafts."""

    def __init__(self, model, cache: KVCache, ops, scale: float, device):
        self.model, self.cache, self.ops, self.scale, self.device = model, cache, ops, scale, device
        self.layer = model.mtp.layers[0]  # one layer drafts every token (as the checkpoints)
        self.first_layer = model.mtp.first_layer

    @torch.inference_mode()
    def run(self, plan: MTPPlan, hidden: torch.Tensor) -> list[list[int]]:
        """hidden: the step's hidden states [T, H] -> drafts per drafting sequence."""
        rows = torch.tensor(plan.hidden_rows, device=hidden.device)
        out = self._forward(plan.catch_up, plan.ids, hidden[rows])  # [T', H]
        if not plan.last_rows:
            return []
        h = out[torch.tensor(plan.last_rows, device=out.device)]  # [B', H]
        drafts: list[list[int]] = [[] for _ in plan.last_rows]
        for j in range(len(plan.steps) + 1):
            tokens = self.model.compute_logits(self.layer.shared_head.norm(h)).argmax(-1).tolist()
            for d, t in zip(drafts, tokens):
                d.append(t)
            if j < len(plan.steps):
                h = self._forward(plan.steps[j], tokens, h)
        return drafts

    def _forward(self, f: MTPForward, ids: list[int], prev: torch.Tensor) -> torch.Tensor:
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=t(f.slots, torch.long),
            query_start_loc=t(f.query_start_loc, torch.int32),
            seq_lens=t(f.seq_lens, torch.int32),
            block_tables=t(f.block_tables, torch.int32),
            is_decode=len(f.positions) == len(f.seq_lens),
        )
        embeds = self.model.model.embed_tokens(t(ids, torch.long))
        attn = _Shifted(PagedAttention(self.ops, self.cache, meta, self.scale), self.first_layer)
        return self.layer.predict(t(f.positions, torch.long), embeds, prev, attn)


class MTPProposer:
    """Rank 0's side: plans each step's MTP work (slots allocated here), runs it locally
    and, with tensor parallelism, on every other rank too (`send`)."""

    def __init__(self, runner: MTPRunner, blocks: BlockManager, send=None):
        self.runner, self.blocks, self.send = runner, blocks, send

    def after_step(
        self,
        spans: list[Span],
        hidden: torch.Tensor,
        rows: list[int],
        draft: list[Sequence],
        k: int,
    ) -> dict[int, list[int]]:
        """spans: positions the step made final per sequence, with their first row in
        hidden [T, H]; draft: the sequences that decode next step -> seq_id -> k drafts."""
        plan, seqs = self.plan(spans, rows, draft, k)
        if plan is None:
            return {}
        if self.send is not None:
            self.send(plan)
        return {s.seq_id: d for s, d in zip(seqs, self.runner.run(plan, hidden))}

    def plan(self, spans, rows, draft, k) -> tuple[MTPPlan | None, list[Sequence]]:
        live = [(s, r) for s, r in zip(spans, rows) if s.count > 0]
        if not live:
            return None, []
        bs = self.runner.cache.spec.block_size
        catch = [Span(s.seq, s.start, s.count, bs) for s, _ in live]
        ids = [t for s in catch for t in s.seq.token_ids[s.start + 1 : s.start + s.count + 1]]
        hidden_rows = [r + i for s, r in live for i in range(s.count)]
        ends = [sum(s.count for s in catch[: i + 1]) - 1 for i in range(len(catch))]
        wanted = {s.seq_id for s in draft}
        keep = [i for i, s in enumerate(catch) if s.seq.seq_id in wanted]
        seqs = [catch[i].seq for i in keep]
        steps = []
        for j in range(k - 1 if seqs else 0):  # draft j + 2 reads draft j + 1 at num_tokens - 1 + j
            if not all(self.blocks.ensure_slots(s, s.num_tokens + j) for s in seqs):
                break  # the pool is short: fewer drafts this time
            steps.append(_forward_of([Span(s, s.num_tokens - 1 + j, 1, bs) for s in seqs]))
        plan = MTPPlan(_forward_of(catch), ids, hidden_rows, [ends[i] for i in keep], steps)
        return plan, seqs
