"""The ingress's view of its prefill and decode replicas' load, for the prefill placement
policy (app/serve/routing/prefill_placement.py): every ``period_s`` each deployment's replicas are
asked for their `placement_load()` with Serve's `broadcast` (a public handle API), and
what this ingress placed since is added on top, so a burst decided between two reports
does not all land on one side. It also tells the prefill replicas the prompt tokens the
decode replicas prefill only because the prefill queue was long (spilled demand), so that
the prefill autoscaler counts them (app/serve/routing/autoscaling.py).

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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray.serve.handle import DeploymentHandle

from app.serve.routing.compute import Compute, shares_compute
from app.serve.routing.prefill_placement import (
    SHARES_COMPUTE,
    DecodeLoad,
    PrefillLoad,
    measured,
)

if TYPE_CHECKING:
    from app.serve.metrics import ReplicaMetrics

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
    spilled_prefill_tokens: int = 0  # a decode replica's, taken from busy prefill replicas

    @classmethod
    def from_report(cls, report: dict) -> ReplicaLoad:
        return cls(
            int(report["queued_prefill_tokens"]),
            int(report["free_kv_tokens"]),
            int(report["num_running"]),
            Compute.from_report(report.get("compute")),
            measured(report.get("prefill_rate")),
            measured(report.get("decode_step_s")),
            int(report.get("spilled_prefill_tokens") or 0),
        )


class LoadView:
    def __init__(
        self,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        period_s: float,
        metrics: ReplicaMetrics | None = None,
    ):
        self.prefill, self.decode, self.period_s = prefill, decode, period_s
        self.metrics = metrics  # the ingress's: SHARES_COMPUTE, refreshed every report
        self.prefill_replicas: list[ReplicaLoad] = []
        self.decode_replicas: list[ReplicaLoad] = []
        self._placed = {"local": 0, "remote": 0}  # prompt tokens placed since the report
        self._task: asyncio.Task | None = None
        self._told = 0  # the spilled tokens last told to the prefill replicas
        self._tell_failing = False

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

    def spilled_tokens(self) -> int:
        """The prompt tokens the decode replicas took from busy prefill replicas (the
        prefill autoscaler's `spilled_prefill_tokens`)."""
        return sum(r.spilled_prefill_tokens for r in self.decode_replicas)

    def update(self, prefill: list[dict], decode: list[dict]) -> None:
        """A new report from every replica: it includes what was placed before it."""
        self.prefill_replicas = [ReplicaLoad.from_report(r) for r in prefill]
        self.decode_replicas = [ReplicaLoad.from_report(r) for r in decode]
        self._placed = {"local": 0, "remote": 0}
        if self.metrics is not None and self.known:
            # set with every report, not only at a placement: Ray drops a gauge not set
            # for two export intervals, and this one describes the replicas, not a request
            self.metrics.set(SHARES_COMPUTE, int(self.prefill_load().shares_compute))

    async def _poll(self) -> None:
        while True:
            try:
                prefill, decode = await asyncio.gather(
                    self.prefill.broadcast("placement_load").results_async(),
                    self.decode.broadcast("placement_load").results_async(),
                )
                self.update(list(prefill), list(decode))
            except Exception as e:  # noqa: BLE001 - a replica restarting: keep the last view
                log.debug("placement load poll failed: %r", e)
            else:  # a fresh total only: a repeated stale one would never let the TTL run out
                await self._tell_spilled()
            await asyncio.sleep(self.period_s)

    async def _tell_spilled(self) -> None:
        """Every prefill replica is told the whole spilled demand (the policy takes the
        largest report: no share to go stale when replicas come and go), while there is
        some and once when it falls to 0; a replica also drops a value no ingress
        refreshes (`SpilledDemand`). A failure is logged once until a tell succeeds."""
        tokens = self.spilled_tokens()
        if not (tokens or self._told):
            return
        try:
            await self.prefill.broadcast("tell_spilled_demand", tokens).results_async()
        except Exception as e:  # noqa: BLE001 - e.g. a replica of a version without it
            level = logging.DEBUG if self._tell_failing else logging.WARNING
            log.log(level, "telling the prefill replicas the spilled demand failed: %r", e)
            self._tell_failing = True
            return
        self._told, self._tell_failing = tokens, False
