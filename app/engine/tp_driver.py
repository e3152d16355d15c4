"""Rank 0 of a tensor-parallel replica drives the other ranks (no Ray here).

Rank 0 runs the whole engine (scheduler, block manager, sampler); every other rank holds only
its shard of the model and of the KV cache (`RankWorker`, app/engine/shard.py) and loops in
`serve_rank`, executing the small messages rank 0 broadcasts: one `Step` per forward pass
(the StepPlan, plain lists), and
`WriteKV` / `ReadKV` for KV import and export. Chunks always carry full KV heads: rank 0
gathers the ranks' head slices on export and each rank keeps its slice on import, so the
chunk layout does not depend on the TP size (docs/parallelism.md).

Messages travel with `broadcast_object_list` on a gloo group (CPU; with NCCL the model's
collectives use their own group): they stay inside one replica's processes, never a trust
boundary. A rank that dies makes rank 0 raise `TPWorkerError` instead of hanging: rank 0
checks its workers before every message and after any failed collective, and the process
group has a finite timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from app.engine.kv_cache import KVCache
from app.engine.model_runner import ModelRunner
from app.engine.step import StepOutput, StepPlan
from app.models.parallel import TPContext


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker rank died or stopped answering; the replica is unusable."""


@dataclass(frozen=True, slots=True)
class Step:
    plan: StepPlan  # plain lists: the same on every rank's device

    def run(self, worker) -> None:
        worker.runner.run(self.plan)


@dataclass(frozen=True, slots=True)
class WriteKV:
    block_ids: list[int]
    kv: torch.Tensor  # [L, P, n, H_total, D] full heads, as raw bytes (uint8)
    scales: torch.Tensor | None  # (torch cannot unpickle float8 tensors: bytes travel)

    @classmethod
    def make(cls, block_ids, kv: torch.Tensor, scales) -> WriteKV:
        kv = kv.cpu().contiguous().view(torch.uint8)
        return cls(list(block_ids), kv, None if scales is None else scales.cpu())

    def run(self, worker) -> None:
        kv = self.kv.view(worker.cache.spec.dtype.storage)
        write_local(worker.cache, self.block_ids, kv, self.scales, worker.ctx)


@dataclass(frozen=True, slots=True)
class ReadKV:
    block_ids: list[int]
    num_tokens: int

    def run(self, worker) -> None:
        gather_heads(worker.cache, self.block_ids, self.num_tokens, worker.ctx)


@dataclass(frozen=True, slots=True)
class MTPDraft:
    plan: Any  # app.engine.spec.mtp.MTPPlan: plain lists, after the Step it drafts from

    def run(self, worker) -> None:
        worker.mtp.run(self.plan, worker.runner.last_hidden)


@dataclass(frozen=True, slots=True)
class Stop:
    def run(self, worker) -> None:  # pragma: no cover - handled by serve_rank
        raise AssertionError


def _rank_heads(cache: KVCache, ctx: TPContext) -> slice:
    if cache.spec.use_mla:  # the latent is replicated: every rank holds the one "head"
        return slice(None)
    first, n = ctx.kv_heads(cache.spec.chunk_kv_heads)
    return slice(first, first + n)


def write_local(cache: KVCache, block_ids, kv, scales, ctx: TPContext) -> None:
    """Keeps this rank's KV heads of full-head chunk tensors."""
    heads = _rank_heads(cache, ctx)
    kv = kv[:, :, :, heads].to(cache.kv.device)
    scales = None if scales is None else scales[:, :, :, heads].to(cache.kv.device)
    KVCache.write_tokens(cache, block_ids, kv, scales)  # this shard only, never broadcast


def _gather(local: torch.Tensor, ctx: TPContext) -> list[torch.Tensor]:
    raw = local.view(torch.uint8)  # gloo has no float8: gather the bytes
    parts = [torch.empty_like(raw) for _ in range(ctx.size)]
    dist.all_gather(parts, raw.contiguous(), group=ctx.group)
    return [p.view(local.dtype) for p in parts]


def gather_heads(cache: KVCache, block_ids, num_tokens: int, ctx: TPContext):
    """Every rank calls it; returns full-head (kv, scales) [L, P, n, H_total, D(, )]."""
    kv, scales = KVCache.read_tokens(cache, block_ids, num_tokens)  # this shard only
    if cache.spec.use_mla:
        return kv, scales
    # One part per distinct head slice (replicated KV heads are taken once), in head order.
    firsts = [
        dataclasses.replace(ctx, rank=r).kv_heads(cache.spec.chunk_kv_heads)[0]
        for r in range(ctx.size)
    ]
    keep = [firsts.index(f) for f in sorted(set(firsts))]
    kv_parts = _gather(kv, ctx)
    kv = torch.cat([kv_parts[r] for r in keep], dim=3)
    if scales is not None:
        sc_parts = _gather(scales, ctx)
        scales = torch.cat([sc_parts[r] for r in keep], dim=3)
    return kv, scales


class TPDriver:
    """Rank 0's handle on its workers: broadcasts messages, reports dead ranks."""

    def __init__(
        self,
        ctx: TPContext,
        device: torch.device,
        control_group: Any,
        dead_workers: Callable[[], list[str]],
        close: Callable[[], None],
    ):
        self.ctx, self.device, self.control_group = ctx, device, control_group
        self._dead_workers, self._close = dead_workers, close
        self.failed: str | None = None
        self.worker_pids: list[int] = []  # for operators and tests

    def check(self) -> None:
        if self.failed is None:
            dead = self._dead_workers()
            if dead:
                self.failed = "tensor-parallel worker " + "; ".join(dead)
        if self.failed is not None:
            raise TPWorkerError(f"{self.failed}: this replica must be restarted")

    def send(self, msg) -> None:
        self.check()
        with self.guard():
            dist.broadcast_object_list([msg], src=0, group=self.control_group)

    def guard(self):
        return _Guard(self)

    def shutdown(self) -> None:
        if self.failed is None:
            with contextlib.suppress(TPWorkerError, RuntimeError):
                self.send(Stop())
        self._close()


class _Guard:
    """Turns a failed collective into TPWorkerError when a worker is gone."""

    def __init__(self, driver: TPDriver):
        self.driver = driver

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and not isinstance(exc, TPWorkerError):
            try:
                self.driver.check()
            except TPWorkerError as dead:
                raise dead from exc
            self.driver.failed = f"collective failed ({exc})"
            raise TPWorkerError(f"{self.driver.failed}: this replica must be restarted") from exc
        return False


class DriverRunner(ModelRunner):
    """Rank 0's runner: broadcasts each step's plan, then runs its own shard."""

    def __init__(self, model, cache: KVCache, ops, head_dim: int, device, driver: TPDriver):
        super().__init__(model, cache, ops, head_dim, device)
        self.driver = driver

    def run(self, plan: StepPlan) -> StepOutput:
        self.driver.send(Step(plan))
        with self.driver.guard():
            return super().run(plan)


class ShardedKVCache(KVCache):
    """Rank 0's cache: its shard for attention, full heads for chunks (every rank joins)."""

    layer_writes = False  # chunks carry every head: write_tokens splits them over ranks

    def __init__(self, spec, num_blocks: int, device, driver: TPDriver):
        super().__init__(spec, num_blocks, device)
        self.driver = driver

    def read_tokens(self, block_ids: list[int], num_tokens: int):
        if self.spec.use_mla:
            return super().read_tokens(block_ids, num_tokens)
        self.driver.send(ReadKV(list(block_ids), num_tokens))
        with self.driver.guard():
            return gather_heads(self, block_ids, num_tokens, self.driver.ctx)

    def write_tokens(self, block_ids: list[int], kv: torch.Tensor, scales) -> None:
        self.driver.send(WriteKV.make(block_ids, kv, scales))
        write_local(self, block_ids, kv, scales, self.driver.ctx)


def min_over_ranks(n: int, ctx: TPContext, device: torch.device) -> int:
    """The smallest n of all ranks (e.g. KV blocks: every rank must hold the same count)."""
    if ctx.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.group)
    return int(t.item())


def serve_rank(worker, control_group: Any) -> None:
    """A worker rank's loop (worker: a RankWorker): run what rank 0 broadcasts until Stop."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control_group)
        if isinstance(box[0], Stop):
            return
        box[0].run(worker)
