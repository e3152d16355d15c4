"""Runs a StepPlan (app/engine/step.py) through the model over the paged KV cache.

No scheduling decisions and no Sequence here: the runner is told exactly which tokens to
compute at which positions and slots, and returns the logits of the rows to sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from app.engine.attention import AttentionMetadata, PagedAttention
from app.engine.cuda_graphs import DecodeGraphs, bucket_sizes
from app.engine.kv_cache import KVCache
from app.engine.step import StepOutput, StepPlan
from app.models.hooks import attn_scale
from app.models.layers import column_major_linears, pack_cpu_linears
from slimserve_kernels import cpu_kernels


@dataclass(slots=True)
class BatchInputs:
    """A StepPlan as tensors on the runner's device."""

    ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] int64: rows of T sampled (k + 1 with k proposed tokens)
    every_row: bool = False  # sample_rows is 0..T-1 (a decode step): no row gather needed


class ModelRunner:
    def __init__(self, model: nn.Module, cache: KVCache, ops, head_dim: int, device):
        self.model, self.cache, self.ops, self.device = model, cache, ops, device
        self.scale = attn_scale(model, head_dim)
        self.block_size = cache.spec.block_size
        self.keep_hidden, self.last_hidden = False, None
        self.graphs: DecodeGraphs | None = None  # decode replays (enable_graphs)
        if torch.device(device).type == "cpu":
            cpu_kernels.build_all()  # the C++ kernels' first build at start, not in a step
            # The C++ float32 linear's weight panels (if built); its forward never reads the
            # weight's layout. Without it F.linear runs faster on column-major weights.
            if not pack_cpu_linears(model):
                column_major_linears(model)

    def enable_graphs(self, max_batch: int, max_len: int, vocab: int, capture=None) -> None:
        """Captures one decode graph per batch bucket up to max_batch (app/engine/cuda_graphs.py).
        capture None = CUDA graphs."""
        width = -(-max_len // self.block_size)
        buckets = bucket_sizes(max_batch)
        with torch.inference_mode():
            self.graphs = DecodeGraphs(
                self._logits_of_all_rows, buckets, width, vocab, self.device, capture
            )

    def _logits_of_all_rows(self, ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        attn = PagedAttention(self.ops, self.cache, meta, self.scale)
        return self.model.compute_logits(self.model(ids, positions, attn))

    def inputs(self, plan: StepPlan) -> BatchInputs:
        """Two host->device tensors per step (one per dtype), split into views. The block
        tables go in flat: torch.tensor of a nested list inspects every inner list."""
        t, s, b = len(plan.token_ids), len(plan.sample_rows), len(plan.seq_lens)
        longs = [*plan.token_ids, *plan.positions, *plan.slot_mapping, *plan.sample_rows]
        ids, positions, slots, rows = self._t(longs, torch.long).split([t, t, t, s])
        flat = [block for table in plan.block_tables for block in table]
        ints = self._t([*plan.query_start_loc, *plan.seq_lens, *flat], torch.int32)
        starts, lens, tables = ints.split([len(plan.query_start_loc), b, len(flat)])
        tables = tables.view(b, len(flat) // max(b, 1))
        meta = AttentionMetadata(slots, starts, lens, tables, plan.is_decode)
        # sample_rows rise strictly inside [0, T) (plan_step), so S == T means they are 0..T-1
        every_row = s == t
        return BatchInputs(ids, positions, meta, rows, every_row)

    def _t(self, data, dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        """One forward pass -> logits [S, vocab] float32 of plan.sample_rows."""
        logits = None
        if self.graphs is not None and not self.keep_hidden:  # MTP reads every hidden row
            logits = self.graphs.run(plan)  # None: not a decode step that fits a bucket
        if logits is None:
            logits = self.forward(self.inputs(plan))
        return StepOutput(logits, plan.sampled)

    @torch.inference_mode()
    def forward(self, inp: BatchInputs) -> torch.Tensor:
        attn = PagedAttention(self.ops, self.cache, inp.meta, self.scale)
        hidden = self.model(inp.ids, inp.positions, attn)  # [T, hidden]
        if self.keep_hidden:  # model proposers (MTP) read every row's hidden state
            self.last_hidden = hidden
        if not len(inp.sample_rows):
            return hidden.new_empty(0, 0, dtype=torch.float32)
        return self.model.compute_logits(hidden if inp.every_row else hidden[inp.sample_rows])
