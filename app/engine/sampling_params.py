"""Per-request sampling parameters; invalid values raise ValueError with the field name."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from app.engine.structured.spec import StructuredOutputSpec


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per step (0 = only the sampled token)
    skip_special_tokens: bool = True
    structured: StructuredOutputSpec | None = None  # output constrained by a grammar

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.n, int) and 1 <= self.n <= 64, "n must be an integer in [1, 64]")
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature must be >= 0")
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1, 0 or >= 1")
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        _check(
            _is_num(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty must be > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, f"{name} must be in [-2, 2]")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be >= 1")
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids must be non-negative integers",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs must be in [0, 20]",
        )
        _check(
            self.structured is None or isinstance(self.structured, StructuredOutputSpec),
            "structured must be a StructuredOutputSpec",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def random_seed() -> int:
    """A fresh seed for a request that gives none (its output is still random per request).

    The ingress picks it, so a disaggregated request's prefill and decode replicas draw the
    same position-keyed noise; the engine picks one only for requests that arrive without."""
    return random.SystemRandom().getrandbits(63)


def _is_num(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
