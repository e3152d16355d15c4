"""Cost-aware speculation: speculate only while it makes tokens faster than plain decoding.

Acceptance alone does not say whether speculation pays: a verify forward over 1 + k query
tokens costs about one decode step on a memory-bound GPU but more on a CPU (1.2 decode
steps at k = 1 for the tiny default model, growing with k), where well-accepted proposals
can still lose. So the engine also measures
what matters, wall time per emitted token, for both kinds of decode-only step:

- a *verify* step: at least one sequence verified proposals;
- a *plain* step: none did (speculation paused, or nothing proposed).

Each kind keeps an exponential moving average of seconds per emitted token (`CostEstimate`);
`CostGovernor.allow()` says whether sequences may propose in the next step: first it
learns each kind's cost (`min_samples` steps of each, speculating first), then it keeps the
cheaper kind, and every `interval` steps it forgets the other kind's estimate (a re-probe),
which makes it relearn that kind for `min_samples` steps, so a workload that turns
repetitive (or a machine that gets faster at verifying) wins speculation back. When a probe
ends, a verdict it confirmed doubles the interval, one it overturned resets it to
`reprobe_every`. The cap depends on the verdict: while speculation pays, plain steps are
re-probed at least every `max_reprobe_every` steps (the plain estimate goes stale: new
workloads, context lengths, machine load); while it does not, every probe is min_samples
verify steps that cost more than they give, so the interval backs off further, to
`max_paused_reprobe_every`, and a workload where speculation never pays spends about
min_samples / max_paused_reprobe_every of its steps verifying (the price: speculation
comes back at most that many steps late). A paused step does nothing but decode: no
proposal lookups, no drafts, no verification bookkeeping.

The clock is injected (tests drive a fake one); the verdict only decides whether tokens are
proposed, never which tokens are emitted, so exactness does not depend on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostPolicy:
    alpha: float = 0.25  # weight of a new sample in the moving average
    min_samples: int = 4  # steps of a kind before its estimate counts
    margin: float = 1.0  # speculate while verify cost <= margin * plain cost
    reprobe_every: int = 16  # steps between re-probes of the losing kind (first interval)
    # While speculating, the interval doubles up to this. Kept short: the plain estimate
    # goes stale (a new workload, other context lengths, machine load), and a probe costs
    # min_samples plain steps where speculation pays.
    max_reprobe_every: int = 64
    # While paused, up to this: each probe costs min_samples verify steps that lose, and
    # speculation returns at most this many steps after a workload turns repetitive.
    max_paused_reprobe_every: int = 256


@dataclass(slots=True)
class CostEstimate:
    """Moving average of seconds per emitted token over one kind of step."""

    seconds_per_token: float = 0.0
    samples: int = 0

    def add(self, seconds_per_token: float, alpha: float) -> None:
        if self.samples == 0:  # the first sample is the estimate (no bias toward 0)
            self.seconds_per_token = seconds_per_token
        else:
            self.seconds_per_token += alpha * (seconds_per_token - self.seconds_per_token)
        self.samples += 1


class CostGovernor:
    """Per engine: whether the next step may speculate (see the module docstring)."""

    def __init__(self, policy: CostPolicy = CostPolicy(), clock: Callable[[], float] | None = None):
        self.policy = policy
        self.clock = clock or time.perf_counter
        self.verify, self.plain = CostEstimate(), CostEstimate()
        self.interval = policy.reprobe_every
        self.since_probe = 0  # decided steps since the last re-probe ended
        self.probing: bool | None = None  # the verdict a re-probe in progress is testing
        self.paused_steps = 0  # steps in which speculation was held back
        self.speculating: bool | None = None  # the last decided verdict
        self.pauses = 0  # times the verdict turned against speculation
        self.resumes = 0  # times it turned back for it
        self.probes = 0  # re-probes started
        self.probe_steps = 0  # steps spent relearning a kind (learning, re-probes)
        self._started: float | None = None

    def allow(self) -> bool:
        """May sequences propose tokens in the next step?"""
        if self.verify.samples < self.policy.min_samples:
            return True
        if self.plain.samples < self.policy.min_samples:
            return False
        return self.verdict()

    def verdict(self) -> bool:
        """Verifying is at most `margin` times as costly per token as plain decoding."""
        p = self.policy
        return self.verify.seconds_per_token <= p.margin * self.plain.seconds_per_token

    def start(self) -> None:
        """A step begins (before proposing: the proposer's time counts too)."""
        self._started = self.clock()

    def finish(self, verified: bool, emitted: int) -> None:
        """A decode-only step that emitted `emitted` tokens ended; verified: some sequence
        verified proposals in it. Steps with prefill work are not reported (their time
        is not decoding)."""
        if self._started is None or emitted <= 0:
            return
        seconds, self._started = self.clock() - self._started, None
        was_decided = self._decided()
        was = was_decided and self.verdict()
        (self.verify if verified else self.plain).add(seconds / emitted, self.policy.alpha)
        if not was_decided:
            self.probe_steps += 1  # this step relearned a kind
        if not self._decided():
            return  # still learning a kind's cost
        if not verified and was_decided and not was:
            self.paused_steps += 1
        self._track(self.verdict())
        if not was_decided and self.probing is not None:
            self._end_probe()
            return
        self.since_probe += 1
        if self.since_probe >= self.interval:
            self._reprobe()

    def _track(self, verdict: bool) -> None:
        """Counts the verdict's turns: pauses (from speculating or learning) and resumes."""
        if verdict != self.speculating:
            self.pauses += not verdict
            self.resumes += verdict and self.speculating is False
            self.speculating = verdict

    def _decided(self) -> bool:
        n = self.policy.min_samples
        return self.verify.samples >= n and self.plain.samples >= n

    def _reprobe(self) -> None:
        """Forgets the losing kind's cost so that allow() relearns it."""
        self.probing, self.since_probe = self.verdict(), 0
        self.probes += 1
        if self.probing:
            self.plain = CostEstimate()
        else:
            self.verify = CostEstimate()

    def _end_probe(self) -> None:
        """The relearned kind has its estimate: a confirmed verdict doubles the interval
        (capped by what the verdict costs to re-probe), an overturned one resets it."""
        p, verdict = self.policy, self.verdict()
        if verdict == self.probing:
            cap = p.max_reprobe_every if verdict else p.max_paused_reprobe_every
            self.interval = min(2 * self.interval, cap)
        else:
            self.interval = p.reprobe_every
        self.probing = None

    def as_dict(self) -> dict[str, float]:
        return {
            "spec_cost_paused_steps": self.paused_steps,
            "spec_cost_pauses": self.pauses,
            "spec_cost_resumes": self.resumes,
            "spec_cost_probes": self.probes,
            "spec_cost_probe_steps": self.probe_steps,
            # seconds per emitted token, verify steps over plain steps (0: not measured yet)
            "spec_cost_ratio": (
                self.verify.seconds_per_token / self.plain.seconds_per_token
                if self.plain.seconds_per_token > 0 and self.verify.samples
                else 0.0
            ),
        }
