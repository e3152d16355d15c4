"""How many torch threads one engine step runs on, chosen by the step's size.

A large prefill step (many new tokens) is a few big GEMMs that split well over threads; a
small decode step is hundreds of tiny ops below torch's intra-op grain, so extra threads
only add OpenMP barriers and, where the other cores serve HTTP (a Serve replica on a small
box), compete with the ingress for them. So steps that compute at least `min_tokens` new
tokens get `max_threads`, the rest one thread.

torch keeps the thread count per OS thread (OpenMP's nthreads ICV), so `apply` must run on
the thread that runs the step; it is called at the start of every step (~0.2 us).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StepThreads:
    max_threads: int  # threads for a large step
    min_tokens: int  # steps computing fewer new tokens run on one thread

    def __post_init__(self):
        assert self.max_threads >= 1 and self.min_tokens >= 1, self

    def threads_for(self, num_tokens: int) -> int:
        return self.max_threads if num_tokens >= self.min_tokens else 1

    def apply(self, num_tokens: int) -> int:
        """Sets the calling thread's torch threads for a step of num_tokens; returns them."""
        n = self.threads_for(num_tokens)
        torch.set_num_threads(n)
        return n
