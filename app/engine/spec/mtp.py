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


class _Shifted:
    """The MTP layer is layer L of the model but layer 0 of its own cache."""

    def __init__(self, attn: PagedAttention, first_layer: int):
        self.attn, self.first_layer = attn, first_layer

    def __call__(self, layer: int, q, k, v):
        return self.attn(layer - self.first_layer, q, k, v)


class MTPProposer:
    def __init__(self, model, cache: KVCache, ops, scale: float, blocks: BlockManager, device):
        self.model, self.cache, self.ops, self.scale = model, cache, ops, scale
        self.blocks, self.device = blocks, device
        self.layer = model.mtp.layers[0]  # one layer drafts every token (as the checkpoints)
        self.first_layer = model.mtp.first_layer

    @torch.inference_mode()
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
        live = [s for s in spans if s.count > 0]
        if not live:
            return {}
        idx = torch.cat([torch.arange(r, r + s.count) for s, r in zip(spans, rows) if s.count])
        ids = [t for s in live for t in s.seq.token_ids[s.start + 1 : s.start + s.count + 1]]
        out = self._forward(live, ids, hidden[idx.to(hidden.device)])  # [sum count, H]
        last = torch.tensor([sum(s.count for s in live[: i + 1]) - 1 for i in range(len(live))])
        wanted = {s.seq_id for s in draft}
        keep = [i for i, s in enumerate(live) if s.seq.seq_id in wanted]
        if not keep:
            return {}
        seqs = [live[i].seq for i in keep]
        h = out[last[keep].to(out.device)]  # [B, H]
        drafts = [[] for _ in seqs]
        for j in range(k):
            tokens = self.model.compute_logits(self.layer.shared_head.norm(h)).argmax(-1).tolist()
            for d, t in zip(drafts, tokens):
                d.append(t)
            if j == k - 1:
                break
            steps = [Span(s, s.num_tokens - 1 + j, 1) for s in seqs]
            if not all(self.blocks.ensure_slots(s, s.num_tokens + j) for s in seqs):
                break  # the pool is short: fewer drafts this time
            h = self._forward(steps, tokens, h)
        return {s.seq_id: d for s, d in zip(seqs, drafts)}

    def _forward(self, spans: list[Span], ids: list[int], prev: torch.Tensor) -> torch.Tensor:
        meta, positions = self._metadata(spans)
        embeds = self.model.model.embed_tokens(torch.tensor(ids, device=self.device))
        attn = _Shifted(PagedAttention(self.ops, self.cache, meta, self.scale), self.first_layer)
        return self.layer.predict(positions, embeds, prev, attn)

    def _metadata(self, spans: list[Span]) -> tuple[AttentionMetadata, torch.Tensor]:
        bs = self.cache.spec.block_size
        pos, slots, starts, lens = [], [], [0], []
        for s in spans:
            table = s.seq.block_table
            pos += range(s.start, s.start + s.count)
            slots += [table[p // bs] * bs + p % bs for p in range(s.start, s.start + s.count)]
            starts.append(starts[-1] + s.count)
            lens.append(s.start + s.count)
        width = max(len(s.seq.block_table) for s in spans)
        tables = [s.seq.block_table + [0] * (width - len(s.seq.block_table)) for s in spans]
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.long),
            query_start_loc=t(starts, torch.int32),
            seq_lens=t(lens, torch.int32),
            block_tables=t(tables, torch.int32),
            is_decode=all(s.count == 1 for s in spans),
        )
        return meta, t(pos, torch.long)
