"""The ingress's view of its prefill and decode replicas' load, for the prefill placement
policy (app/serve/routing/prefill_placement.py): every ``period_s`` each deployment's replicas are
asked for their `placement_load()` with Serve's `broadcast` (a public handle API), and
what this ingress placed since is added on top, so a burst decided between two reports
does not all land on one side. It also passes on to the prefill replicas the prefill demand
the decode replicas took (long prompts placed locally), so that the prefill autoscaler
counts it (app/serve/routing/autoscaling.py).

The prefill side is its least-loaded replica (where the token-aware router sends a prompt);
the decode side is the decode replica with the most KV headroom (where the router sends
the choice). Each side's prefill rate and the decode side's step time are what those
replicas measured of their own steps (app/engine/step_rates.py); whether the two share
compute comes from where each reports it runs. Until
the first report, the view says nothing is known and the policy falls back to the
prompt-length rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

from ray.serve.handle import DeploymentHandle

from app.serve.routing.compute import Compute, shares_compute
from app.serve.routing.prefill_placement import DecodeLoad, PrefillLoad, measured

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What one engine replica reports (`EngineHost.placement_load`), typed. Replicas send
    a plain dict: during a rolling update a replica of another version may lack a key or
    add one, which a dict survives and a pickled dataclass of another shape does not."""

    queued_prefill_tokens: int  # prompt tokens admitted and not yet computed there
    free_kv_tokens: int
    num_running: int
    compute: Compute | None = None  # where it runs (None: not reported)
    prefill_rate: float | None = None  # its measured prefill tokens/s (None: not yet)
    decode_step_s: float | None = None  # its measured decode step time (None: not yet)
    prefill_demand_tokens: int = 0  # a decode replica's local prefills over the short limit

    @classmethod
    def from_report(cls, report: dict) -> ReplicaLoad:
        return cls(
            int(report["queued_prefill_tokens"]),
            int(report["free_kv_tokens"]),
            int(report["num_running"]),
            Compute.from_report(report.get("compute")),
            measured(report.get("prefill_rate")),
            measured(report.get("decode_step_s")),
            int(report.get("prefill_demand_tokens") or 0),
        )


class LoadView:
    def __init__(self, prefill: DeploymentHandle, decode: DeploymentHandle, period_s: float):
        self.prefill, self.decode, self.period_s = prefill, decode, period_s
        self.prefill_replicas: list[ReplicaLoad] = []
        self.decode_replicas: list[ReplicaLoad] = []
        self._placed = {"local": 0, "remote": 0}  # prompt tokens placed since the report
        self._task: asyncio.Task | None = None
        self._told = 0  # the share last sent to the prefill replicas

    @property
    def known(self) -> bool:
        return bool(self.prefill_replicas) and bool(self.decode_replicas)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def placed(self, where: str, tokens: int) -> None:
        self._placed[where] += tokens

    def prefill_load(self) -> PrefillLoad:
        least = min(self.prefill_replicas, key=lambda r: r.queued_prefill_tokens)
        queued = least.queued_prefill_tokens + self._placed["remote"]
        shared = shares_compute(least.compute, self._decode_replica().compute)
        return PrefillLoad(queued, len(self.prefill_replicas), least.prefill_rate, shared)

    def decode_load(self) -> DecodeLoad:
        best = self._decode_replica()
        queued = best.queued_prefill_tokens + self._placed["local"]
        return DecodeLoad(
            best.free_kv_tokens, best.num_running, queued, best.decode_step_s, best.prefill_rate
        )

    def _decode_replica(self) -> ReplicaLoad:
        """The one with the most KV headroom (where the router sends the choice)."""
        return max(self.decode_replicas, key=lambda r: r.free_kv_tokens - r.queued_prefill_tokens)

    def spilled_share(self) -> int:
        """Each prefill replica's share of the prefill demand its decode replicas took
        (the prefill autoscaler's `spilled_prefill_tokens`: the deployment's sum is the
        decode replicas' total)."""
        total = sum(r.prefill_demand_tokens for r in self.decode_replicas)
        return math.ceil(total / len(self.prefill_replicas)) if self.prefill_replicas else 0

    def update(self, prefill: list[dict], decode: list[dict]) -> None:
        """A new report from every replica: it includes what was placed before it."""
        self.prefill_replicas = [ReplicaLoad.from_report(r) for r in prefill]
        self.decode_replicas = [ReplicaLoad.from_report(r) for r in decode]
        self._placed = {"local": 0, "remote": 0}

    async def _poll(self) -> None:
        while True:
            try:
                prefill, decode = await asyncio.gather(
                    self.prefill.broadcast("placement_load").results_async(),
                    self.decode.broadcast("placement_load").results_async(),
                )
                self.update(list(prefill), list(decode))
                await self._tell_spilled()
            except Exception as e:  # noqa: BLE001 - a replica restarting: keep the last view
                log.debug("placement load poll failed: %r", e)
            await asyncio.sleep(self.period_s)

    async def _tell_spilled(self) -> None:
        """The prefill replicas' share of the demand spilled to decode replicas, sent
        while there is some and once when it falls to 0 (a replica also drops a share
        no ingress refreshes: `SpilledDemand`)."""
        share = self.spilled_share()
        if share or self._told:
            await self.prefill.broadcast("tell_spilled_demand", share).results_async()
        self._told = share
