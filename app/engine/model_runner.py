"""Turns a scheduled batch into model inputs, runs the forward pass, returns logits.

No scheduling decisions here: the runner is told which sequences run and how many new
tokens each computes this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.engine.attention import AttentionMetadata, PagedAttention
from app.engine.kv_cache import KVCache
from app.engine.sequence import Sequence


@dataclass(slots=True)
class BatchInputs:
    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: rows of T sampled (k + 1 with k proposed tokens)
    sampled: list[Sequence]  # the S sequences, in row order


class ModelRunner:
    def __init__(self, model: nn.Module, cache: KVCache, ops, head_dim: int, device):
        self.model, self.cache, self.ops, self.device = model, cache, ops, device
        # A model whose softmax scale is not head_dim**-0.5 (MLA, YaRN mscale) declares it.
        self.scale = getattr(model, "attn_scale", None) or head_dim**-0.5
        self.block_size = cache.spec.block_size
        self.keep_hidden, self.last_hidden = False, None

    def prepare(self, batch: list[tuple[Sequence, int]], all_rows: bool = False) -> BatchInputs:
        bs = self.block_size
        ids, pos, slots, starts, lens, rows, sampled = [], [], [], [0], [], [], []
        for seq, n in batch:
            start = seq.num_computed_tokens
            tokens = seq.token_ids + seq.spec_tokens if seq.spec_tokens else seq.token_ids
            ids += tokens[start : start + n]
            pos += range(start, start + n)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            starts.append(starts[-1] + n)
            lens.append(start + n)
            if all_rows:
                rows += range(starts[-2], starts[-1])
            elif start + n == len(tokens):  # with k proposals: k + 1 rows to verify them
                rows += range(starts[-1] - 1 - len(seq.spec_tokens), starts[-1])
                sampled.append(seq)
        width = max(len(seq.block_table) for seq, _ in batch)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch]
        meta = AttentionMetadata(
            slot_mapping=self._t(slots, torch.long),
            query_start_loc=self._t(starts, torch.int32),
            seq_lens=self._t(lens, torch.int32),
            block_tables=self._t(tables, torch.int32),
            is_decode=all(n == 1 for _, n in batch),
        )
        return BatchInputs(
            self._t(ids, torch.long),
            self._t(pos, torch.long),
            meta,
            self._t(rows, torch.long),
            sampled,
        )

    def _t(self, data, dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def execute(
        self, batch: list[tuple[Sequence, int]], all_rows: bool = False
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one step; returns (logits [S, vocab] float32, the S sequences to sample).

        all_rows: logits of every new token instead (scoring), and no sequence to sample.
        """
        inp = self.prepare(batch, all_rows)
        return self.forward(inp), inp.sampled

    @torch.inference_mode()
    def forward(self, inp: BatchInputs) -> torch.Tensor:
        """The forward pass alone (tensor-parallel workers run it on rank 0's inputs)."""
        attn = PagedAttention(self.ops, self.cache, inp.meta, self.scale)
        hidden = self.model(inp.ids, inp.positions, attn)  # [T, hidden]
        if self.keep_hidden:  # model proposers (MTP) read every row's hidden state
            self.last_hidden = hidden
        if not len(inp.sample_rows):
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden[inp.sample_rows])
