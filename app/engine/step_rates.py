"""What an engine's own steps measure: its decode step time and its prefill rate.

The serving layer places each long prompt on a prefill replica or on its decode replica
from these (app/serve/routing/prefill_placement.py): a queue of prompt tokens becomes a
time to first token at the replica's prefill rate, and the decode replica's step time says
how much a prefill chunk would slow its running sequences' tokens.

Each step's wall time (forward and sampling: what a token waits for) is split by what the
step computed:

- a step of decode rows only: a sample of the decode step time (an exponentially weighted
  moving average, ``alpha`` per step);
- a step with at least ``min_prefill_tokens`` prompt tokens: its time less one decode step
  when it also carried decode rows (at least ``MIN_PREFILL_SHARE`` of the step stays prefill
  time, so one noisy step cannot make the rate unbounded), and the rate is the moving sum of
  prefill tokens over the moving sum of those seconds: a chunk of a few hundred tokens
  counts for its tokens, not as one sample of tokens per second.
- a step with fewer prompt tokens (a prompt's tail after a remote prefill or a prefix
  cache hit: the engine computes at least its last token) says nothing: its time is the
  decode rows' and the step's fixed cost, and counted as prefill it would read as a rate
  far below the engine's, the more so the more prompts go elsewhere.

Until a kind of step has run, its value is None (not measured). The two moving sums are
one tuple, replaced whole: the replica's event loop reads them while the step thread
writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MIN_PREFILL_SHARE = 0.25  # of a mixed step's time, counted as prefill whatever decode costs


@dataclass(slots=True)
class StepRates:
    alpha: float = 0.2  # weight of a new step in the moving averages
    min_prefill_tokens: int = 64  # fewer prompt tokens in a step: no prefill sample
    decode_step_s: float | None = None
    _prefill: tuple[float, float] | None = None  # moving sums (tokens, seconds)

    def __post_init__(self):
        assert 0 < self.alpha <= 1 and self.min_prefill_tokens >= 1, self

    def record(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step: ``prefill_tokens`` prompt tokens computed beside ``decode_rows``
        sequences past their prompt, in ``seconds`` of wall time."""
        if seconds <= 0 or (prefill_tokens == 0 and decode_rows == 0):
            return
        if prefill_tokens == 0:
            self.decode_step_s = self._mean(self.decode_step_s, seconds)
            return
        if prefill_tokens < self.min_prefill_tokens:
            return
        decode_s = (self.decode_step_s or 0.0) if decode_rows else 0.0
        prefill_s = max(seconds - decode_s, seconds * MIN_PREFILL_SHARE)
        if self._prefill is None:
            self._prefill = (float(prefill_tokens), prefill_s)
            return
        tokens, spent = self._prefill
        self._prefill = (self._mean(tokens, prefill_tokens), self._mean(spent, prefill_s))

    @property
    def prefill_tokens_per_s(self) -> float | None:
        sums = self._prefill  # one read: a consistent pair
        return sums[0] / sums[1] if sums is not None and sums[1] > 0 else None

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)


def step_work(scheduled: list[tuple[Any, int]]) -> tuple[int, int]:
    """(prefill tokens, decode rows) of a scheduled step's (sequence, new tokens) pairs: a
    sequence computing more than one token of its own (a prompt chunk, or a preempted
    sequence recomputing its outputs) prefills; one token, plus any proposed tokens it
    verifies, is a decode row."""
    prefill = decode_rows = 0
    for seq, n in scheduled:
        own = n - len(seq.spec_tokens)
        if seq.prompt_done and own == 1:
            decode_rows += 1
        else:
            prefill += own
    return prefill, decode_rows
