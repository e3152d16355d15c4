"""Decode steps replayed from graphs captured once per batch-size bucket.

An eager decode step launches hundreds of small kernels; on a GPU their launch cost can
exceed the step's HBM time. `DecodeGraphs` captures one decode forward (model + logits) per
bucket of batch sizes at start-up and replays it: a step of n sequences fills static input
buffers, pads to the smallest bucket >= n and replays that bucket's graph.

- Static buffers: token ids, positions, slots, sequence lengths [N_max] and block tables
  [N_max, W] (W = blocks of the longest sequence the model allows) are allocated once; a
  bucket's graph reads views of their first N rows, so their addresses never change.
- Padding: rows n..N-1 repeat row n-1's token, position, length and block table (valid
  inputs everywhere) with slot -1, which every kv_write skips (the kernels' contract), so
  padding never writes the cache; their logits are dropped.
- Logits: every graph writes into one shared [N_max, V] buffer (rows :N), so the graphs'
  memory is one buffer, not one per bucket; `run` returns a copy of the sampled rows.
- Fallback (eager): a prefill or mixed step, more sequences than the largest bucket, a
  block table wider than W, or a runner that must keep hidden states (MTP proposers).
- Not captured at all (`capturable`): models with an MoE layer on the per-expert loop (it
  reads the expert counts on the host, which a graph cannot record; an H200 run found capture
  failing there when the fused kernels did too). The fused MoE path sizes its padded layout
  from the shapes alone (slimserve_kernels/moe_common.py `align_rows`), so it is captured.

`capture` is pluggable: `capture_cuda` records a torch.cuda.CUDAGraph; `capture_eager` only
re-runs the forward on the static buffers (CPU tests check bucketing, padding and buffer
reuse with it; it saves nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.engine.attention import AttentionMetadata
from app.engine.step import StepPlan
from app.models.moe import MoE


def capturable(model: torch.nn.Module) -> bool:
    """Whether decode steps of `model` can be recorded as CUDA graphs: every MoE layer runs
    the fused kernels (no host sync), none the per-expert loop."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    return all(m.use_fused and m.fused_weights() is not None for m in moes)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then the multiples of 8 below max_batch, then max_batch itself: small steps
    waste little padding, large ones at most 7 rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1, 2, 4, *range(8, max_batch, 8)]
    return [s for s in sizes if s < max_batch] + [max_batch]


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket >= n, or None when n is larger than every bucket."""
    for size in buckets:
        if size >= n:
            return size
    return None


class Replayable:
    """A captured step: `replay()` recomputes the capture's outputs from the static inputs."""

    def replay(self) -> None:  # pragma: no cover - protocol
        raise NotImplementedError


class EagerReplay(Replayable):
    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def capture_eager(fn: Callable[[], None], pool=None) -> Replayable:
    fn()  # a first run, as a CUDA capture does (and fails here, not mid-step, if broken)
    return EagerReplay(fn)


class CudaReplay(Replayable):
    def __init__(self, graph):
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


def capture_cuda(fn: Callable[[], None], pool=None) -> Replayable:
    """Warm up on a side stream (lazy inits, Triton autotune), then capture into pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return CudaReplay(graph)


@dataclass(slots=True)
class StaticInputs:
    """The buffers every graph reads (rows :N of each for bucket N)."""

    ids: torch.Tensor  # [N_max] int64
    positions: torch.Tensor  # [N_max] int64
    slots: torch.Tensor  # [N_max] int64
    seq_lens: torch.Tensor  # [N_max] int32
    block_tables: torch.Tensor  # [N_max, W] int32
    logits: torch.Tensor  # [N_max, V] float32

    @classmethod
    def allocate(cls, n: int, width: int, vocab: int, device) -> StaticInputs:
        def z(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            z(n), z(n), z(n), z(n, dtype=torch.int32), z(n, width, dtype=torch.int32),
            z(n, vocab, dtype=torch.float32),
        )  # fmt: skip

    def meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:n],
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.slots.device),
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            is_decode=True,
        )


PAD_SLOT = -1  # kv_write skips slots < 0


def pad_rows(plan: StepPlan, size: int) -> tuple[list[list[int]], list[list[int]]]:
    """A decode plan's per-row fields padded to size by repeating its last row, slot -1:
    ([ids, positions, slots, seq_lens] each [size], block tables [size][w])."""
    extra = size - len(plan.seq_lens)
    ids, pos, lens = (
        list(r) + [r[-1]] * extra for r in (plan.token_ids, plan.positions, plan.seq_lens)
    )
    slots = list(plan.slot_mapping) + [PAD_SLOT] * extra
    tables = list(plan.block_tables) + [plan.block_tables[-1]] * extra
    return [ids, pos, slots, lens], tables


Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """One captured decode forward per bucket; `run` replays the one that fits a plan."""

    def __init__(self, forward: Forward, buckets, width: int, vocab: int, device, capture=None):
        """forward(ids [N], positions [N], meta) -> logits [N, vocab] of every row. Capture
        runs the forward on dummy static inputs whose slots are all -1: it writes nothing
        into the cache."""
        self.buckets, self.width, self.device = sorted(buckets), width, torch.device(device)
        self.buf = StaticInputs.allocate(self.buckets[-1], width, vocab, device)
        self.buf.seq_lens.fill_(1)  # a valid context of one token for the captures
        self.buf.slots.fill_(PAD_SLOT)
        capture = capture or capture_cuda
        pool = torch.cuda.graph_pool_handle() if capture is capture_cuda else None
        self.graphs: dict[int, Replayable] = {}
        self.replays = dict.fromkeys(self.buckets, 0)  # per bucket, for tests and stats
        self.fallbacks = 0
        for n in reversed(self.buckets):  # largest first: smaller ones reuse its pool memory
            self.graphs[n] = capture(self._step_fn(forward, n), pool)

    def _step_fn(self, forward: Forward, n: int) -> Callable[[], None]:
        buf, meta = self.buf, self.buf.meta(n)

        def step() -> None:
            buf.logits[:n].copy_(forward(buf.ids[:n], buf.positions[:n], meta))

        return step

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The bucket that replays this plan, or None (eager: see the module docstring)."""
        if not plan.is_decode or not plan.seq_lens:
            return None
        if plan.block_tables and len(plan.block_tables[0]) > self.width:
            return None
        return pick_bucket(self.buckets, len(plan.seq_lens))

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """logits [S, vocab] of plan.sample_rows (a copy), or None when the plan runs eager."""
        size = self.bucket_for(plan)
        if size is None:
            self.fallbacks += 1
            return None
        self._fill(plan, size)
        self.graphs[size].replay()
        self.replays[size] += 1
        rows = torch.tensor(plan.sample_rows, dtype=torch.int64, device=self.device)
        return self.buf.logits.index_select(0, rows)  # copied: the next replay overwrites

    def _fill(self, plan: StepPlan, size: int) -> None:
        rows, tables = pad_rows(plan, size)
        host = torch.tensor(rows, dtype=torch.int64)  # [4, size]
        table = torch.tensor(tables, dtype=torch.int32)  # [size, w]
        if self.device.type == "cuda":  # one pinned staging copy each, no sync
            host, table = host.pin_memory(), table.pin_memory()
        b, w = self.buf, table.shape[1]
        b.ids[:size].copy_(host[0], non_blocking=True)
        b.positions[:size].copy_(host[1], non_blocking=True)
        b.slots[:size].copy_(host[2], non_blocking=True)
        b.seq_lens[:size].copy_(host[3], non_blocking=True)  # int64 -> int32 on the way
        b.block_tables[:size, :w].copy_(table, non_blocking=True)
        b.block_tables[:size, w:].zero_()  # stale ids past w: never read, zeroed anyway
