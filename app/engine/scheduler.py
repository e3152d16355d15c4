"""Continuous batching: which sequences run this step and how many tokens each computes.

Per step, under a token budget: running decodes first (one token each), then running
prefills continue (chunked), then waiting sequences are admitted.

The budget follows the prompts (`light_load_step_tokens`): while every prompt left to
compute fits in one light step, steps are light, so a burst of short prompts is prefilled a
few at a time (the first get their first token sooner, decodes wait less). While a longer
one is running or waiting, steps grow to `max_num_batched_tokens`, so long prompts are
prefilled whole and a queue of them drains as fast as it arrives instead of waiting for
its first token (docs/long_prompts.md "The served token budget"). With
`decode_steps_after_prefill` k > 0, a step that prefilled a long chunk is followed by k
steps of the running decodes alone. When the block pool runs dry the most recently admitted
sequence is preempted: its blocks are released (they stay in the prefix cache) and it is
recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import chain

from app.config import SchedulerConfig
from app.engine.block_manager import BlockManager
from app.engine.request import OverloadedError
from app.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, new tokens)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._decode_only_steps = 0  # left after a long prefill chunk (decode_steps_after_prefill)

    def add(self, seqs: list[Sequence]) -> None:
        if len(self.waiting) + len(seqs) > self.config.max_waiting:
            raise OverloadedError(
                f"server overloaded: {len(self.waiting)} requests already waiting "
                f"(limit {self.config.max_waiting}); retry later"
            )
        self.waiting.extend(seqs)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        decodes = [s for s in self.running if s.is_decode]
        prefills = [s for s in self.running if not s.is_decode]
        if self._decode_only_steps and decodes:
            self._decode_only_steps -= 1
            full = self.config.max_num_batched_tokens
            self._continue(decodes, full, full, out)
            return out
        budget, chunk = self._step_budget(prefills)
        budget = self._continue(decodes + prefills, budget, chunk, out)
        if not out.preempted:  # memory is short: don't admit what would be preempted next
            self._admit(out, budget, chunk)
        self._decode_only_steps = self._decode_steps_after(out)
        return out

    def _continue(self, seqs: list[Sequence], budget: int, chunk: int, out: SchedulerOutput) -> int:
        """Schedules running sequences in order; returns the budget left."""
        for seq in seqs:
            if seq.status is not SeqStatus.RUNNING or budget == 0:
                continue
            # A decode with proposed tokens verifies them in this step (as an extend).
            n = min(seq.num_uncomputed + len(seq.spec_tokens), budget, chunk)
            seq.spec_tokens = seq.spec_tokens[: max(0, n - seq.num_uncomputed)]
            if self._reserve(seq, n, out):
                out.scheduled.append((seq, n))
                budget -= n
        return budget

    def _decode_steps_after(self, out: SchedulerOutput) -> int:
        """Decode-only steps owed by this step: a long prompt chunk in it made every decode
        wait for it, so the next steps are theirs alone. At most one gap in k + 1 between a
        sequence's tokens then carries a long prefill (docs/long_prompts.md "Decode steps
        after a long prefill")."""
        k, long_chunk = (
            self.config.decode_steps_after_prefill,
            self.config.prefill_chunk_for_decode_steps,
        )
        long = any(n >= long_chunk for s, n in out.scheduled if not s.prompt_done)
        return k if long else 0

    def _step_budget(self, prefills: list[Sequence]) -> tuple[int, int]:
        """(tokens this step, tokens of one sequence): the full budget while a prompt left
        to compute (running or waiting) needs more than a light step, else the light one."""
        full, chunk = self.config.max_num_batched_tokens, self.config.long_prefill_chunk
        light = self.config.light_load_step_tokens
        if light is None or any(s.num_uncomputed > light for s in chain(prefills, self.waiting)):
            return full, chunk
        return min(light, full), min(light, chunk)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Finds blocks for n more tokens of seq, preempting later sequences if needed."""
        while not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
            scheduled = {s.seq_id for s, _ in out.scheduled}  # only when short: O(B) each
            victims = [s for s in self.running if s.seq_id not in scheduled and s is not seq]
            self.preempt(victims[-1] if victims else seq, out)
            if not victims:
                return False
        return True

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _admit(self, out: SchedulerOutput, budget: int, chunk: int) -> None:
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if seq.wait_for is not None and not _sibling_ready(seq.wait_for):
                continue
            if seq.grammar is not None and not seq.grammar.ready:
                continue  # its grammar is still compiling (off the step loop)
            if seq.kv_hold is not None and not seq.kv_hold.ready:
                continue  # its imported KV is still being written (app/engine/transfers.py)
            if not seq.block_table:
                self.blocks.match_prefix(seq)
            n = min(seq.num_uncomputed, budget, chunk)
            if not self.blocks.ensure_slots(seq, seq.num_computed_tokens + n):
                self.blocks.free(seq)  # give back pinned prefix blocks; retry next step
                seq.reset_for_recompute()
                return
            self.waiting.remove(seq)
            if seq.kv_hold is not None:  # match_prefix pinned the imported blocks again
                self.blocks.release_hold(seq.kv_hold)
                seq.kv_hold = None
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and releases its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)


def _sibling_ready(first: Sequence) -> bool:
    """n > 1: later samples start once the first has the prompt's KV in the prefix cache."""
    return first.prompt_done or first.finished
