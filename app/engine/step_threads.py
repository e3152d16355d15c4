"""How many torch threads one engine step runs on, chosen by its longest prompt chunk.

A long prompt's prefill step is a few big GEMMs and a long causal attention that split well
over threads (the C++ kernels take torch's intra-op threads); a decode step is dozens of
small parallel regions, each waking the other threads for little work. Steps are sized by
their longest chunk, not their total: a burst of short prompts fills a step as well, but it
streams many tokens per unit of compute, so on a small box the other cores are busy serving
HTTP then, while a long prompt's step streams one token after much compute (measured:
docs/long_prompts.md "Threads for long prompts"). So a step in which one sequence computes
at least `min_tokens` new tokens gets `max_threads`, the rest one thread.

torch keeps the thread count per OS thread (OpenMP's nthreads ICV), so `apply` must run on
the thread that runs the step; it is called at the start of every step (~0.2 us).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

# A container's CPU limit: cgroup v2's "quota period" (or "max period"), or v1's two files.
CGROUP_V2 = "/sys/fs/cgroup/cpu.max"
CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cpus(v2: str = CGROUP_V2, v1: tuple[str, str] = CGROUP_V1) -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup CPU quota (a
    Kubernetes CPU limit is a quota, not a cpuset, so the affinity alone would be every
    core of the node)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _quota(v2, v1)
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _quota(v2: str, v1: tuple[str, str]) -> float | None:
    """CPUs the cgroup's quota allows (None: no quota, or no cgroup file)."""
    words = _read(v2).split()  # v2: "quota period" in one file
    if len(words) < 2:
        words = [_read(path).strip() for path in v1]
    quota, period = words[:2]
    if not quota or quota in ("max", "-1") or not period:
        return None
    return int(quota) / int(period)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class StepThreads:
    max_threads: int  # threads for a large step
    min_tokens: int  # steps computing fewer new tokens run on one thread

    def __post_init__(self):
        assert self.max_threads >= 1 and self.min_tokens >= 1, self

    def threads_for(self, longest: int) -> int:
        return self.max_threads if longest >= self.min_tokens else 1

    def apply(self, longest: int) -> int:
        """Sets the calling thread's torch threads for a step whose longest chunk is
        `longest` new tokens of one sequence; returns them."""
        n = self.threads_for(longest)
        torch.set_num_threads(n)
        return n
