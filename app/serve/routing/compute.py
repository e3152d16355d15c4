"""Where an engine replica computes, and whether a prefill replica shares its decode
replica's compute.

Disaggregation pays when prefill and decode run on different hardware: the decode
replica's steps then never wait for a prompt's prefill. A prefill replica on the same cores
(or the same GPU) buys no compute: its prefill takes the cycles the decode replica's steps
would have used, and the hand-off adds its own work (the KV's export, publish, fetch and
import). On the 2-core box a request of a 1,000-token prompt cost ~230 ms of CPU prefilled
remotely against ~170 ms prefilled where it decodes, and at 32 streams the queue-balanced
placement left TTFT p50 2.5-3x the all-local one at the same throughput
(docs/long_prompts.md "Shared compute"). So the placement policy prefills on the decode
replica when the two share compute, unless that replica cannot take the prompt
(app/serve/routing/prefill_placement.py).

Two replicas share compute when they run on the same node and either hold a common GPU,
or, without GPUs, their long steps' threads together exceed the CPUs both may run on (with
`torch_threads: auto` each wants every CPU it may use, so two CPU replicas on one node
always do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True, slots=True)
class Compute:
    node_id: str
    gpus: tuple[str, ...]  # accelerator ids Ray gave the replica
    cpus: tuple[int, ...]  # the CPUs its process may run on (affinity)
    threads: int  # torch threads of its long steps

    def __post_init__(self):
        assert self.threads >= 1 and self.cpus, self

    def report(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "gpus": list(self.gpus), "cpus": list(self.cpus),
                "threads": self.threads}  # fmt: skip

    @classmethod
    def from_report(cls, report: dict[str, Any] | None) -> Compute | None:
        if not report:
            return None
        gpus = tuple(str(g) for g in report["gpus"])
        cpus = tuple(int(c) for c in report["cpus"])
        return cls(str(report["node_id"]), gpus, cpus, int(report["threads"]))


def this_replica(threads: int) -> Compute:
    """The calling Ray worker's compute (in a replica: at start)."""
    context = ray.get_runtime_context()
    gpus = tuple(str(g) for g in context.get_accelerator_ids().get("GPU", []))
    cpus = tuple(sorted(os.sched_getaffinity(0)))
    return Compute(context.get_node_id(), gpus, cpus, max(1, threads))


def shares_compute(a: Compute | None, b: Compute | None) -> bool:
    """Whether replicas ``a`` and ``b`` compete for the same cores or GPU (unknown: no)."""
    if a is None or b is None or a.node_id != b.node_id:
        return False
    if a.gpus or b.gpus:
        return bool(set(a.gpus) & set(b.gpus))
    common = len(set(a.cpus) & set(b.cpus))
    return common > 0 and a.threads + b.threads > common
