"""N-gram (prompt lookup) proposer: no weights, only the sequence's own tokens.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are searched for in
the earlier tokens of prompt + output; the tokens that followed the most recent earlier
occurrence of the longest matching n-gram are the proposal. Most recent, because a text
that repeats itself tends to repeat what it said last (edits, code, quotes).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, prompt_lookup_min: int = 2, prompt_lookup_max: int = 4):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens continuing token_ids; [] when no n-gram recurs."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _latest_match(tokens, n)
            if start is not None:
                follow = start + n  # the continuation may run into the suffix itself
                return tokens[follow : follow + k].tolist()
        return []


def _latest_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the last occurrence of tokens[-n:] that ends before the final token."""
    windows = sliding_window_view(tokens[:-1], n)  # [L - n, n]: every earlier n-gram
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if len(hits) else None


class AcceptanceBackoff:
    """Per-sequence number of tokens to propose, from how many were accepted lately.

    An exponential moving average of the accepted fraction scales k down; below `floor`
    the sequence stops speculating and probes again (k = 1) every `probe_every` steps, so a
    prompt with no repetition costs (almost) nothing over plain decoding.
    """

    def __init__(self, k: int, alpha: float = 0.3, floor: float = 0.15, probe_every: int = 8):
        self.k, self.alpha, self.floor, self.probe_every = k, alpha, floor, probe_every
        self.rate = 1.0  # optimistic start: the first proposals go out at full length
        self.idle_steps = 0

    def num_to_propose(self) -> int:
        if self.rate >= self.floor:
            return max(1, round(self.k * min(1.0, self.rate * 1.5)))
        self.idle_steps += 1
        return 1 if self.idle_steps % self.probe_every == 0 else 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed > 0:
            self.rate += self.alpha * (accepted / proposed - self.rate)
