"""The typed seams of one engine step (plain data: no Sequence crosses into the runner).

    schedule (scheduler.py) -> plan (`plan_step`: StepPlan) -> run (ModelRunner.run:
    StepOutput) -> sample -> apply (Engine._apply, the one place that changes sequences,
    blocks and outputs)

A StepPlan is what tensor-parallel ranks receive too: token ids, positions, the slot of
every new token, block tables, and which rows are sampled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class Scheduled(Protocol):
    """What planning reads of a sequence (Sequence, or a speculative draft's view)."""

    token_ids: list[int]
    spec_tokens: list[int]
    num_computed_tokens: int
    block_table: list[int]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One forward pass over B sequences and T new tokens."""

    token_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]: block_id * block_size + offset of every new token
    query_start_loc: list[int]  # [B + 1]: row of each sequence's first new token
    seq_lens: list[int]  # [B]: cached + new tokens
    block_tables: list[list[int]]  # [B, max_blocks], zero-padded
    sample_rows: list[int]  # [S]: rows whose logits come back
    sampled: list[int]  # indices in the batch of the sequences that sample, in row order
    is_decode: bool  # every sequence has exactly one new token


@dataclass(frozen=True, slots=True)
class StepOutput:
    logits: torch.Tensor  # [S, vocab] float32, rows in StepPlan.sample_rows order
    sampled: list[int]  # = StepPlan.sampled


def plan_step(batch: list[tuple[Scheduled, int]], block_size: int, all_rows: bool = False):
    """(sequence, new tokens) pairs -> StepPlan. A sequence samples when its new tokens reach
    its end: 1 row, or k + 1 rows with k proposed tokens to verify. all_rows: every new
    token's row (scoring) and nothing sampled."""
    bs = block_size
    ids, pos, slots, starts, lens, rows, sampled = [], [], [], [0], [], [], []
    for i, (seq, n) in enumerate(batch):
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
        elif start + n == len(tokens):
            rows += range(starts[-1] - 1 - len(seq.spec_tokens), starts[-1])
            sampled.append(i)
    width = max(len(seq.block_table) for seq, _ in batch)
    tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in batch]
    is_decode = all(n == 1 for _, n in batch)
    return StepPlan(ids, pos, slots, starts, lens, tables, rows, sampled, is_decode)


def execute(runner, batch: list[tuple[Scheduled, int]], all_rows: bool = False):
    """Plan and run a batch -> (logits [S, vocab], the S sampled batch members in row order)."""
    out = runner.run(plan_step(batch, runner.block_size, all_rows))
    return out.logits, [batch[i][0] for i in out.sampled]
