"""KV transfer off the step: a side thread (on CUDA, a side stream) imports and exports
chunks while the engine keeps stepping (no Ray).

The step thread only plans and hands jobs over; the worker does the payload work (reading
the cache and encoding chunks, or writing imported chunks into pinned blocks) and posts the
result to a done queue. Everything that touches the BlockManager or a sequence happens on
the step thread, in ``poll`` at the start of each step, so the BlockManager stays
single-threaded:

- export: the sequence's blocks stay pinned (``hand_over``) until the worker has read them;
  the first token's delta goes out at once (not final: the caller need not wait for the
  copy), and the request's final delta, no token, comes back from ``poll`` with
  ``exported_chunks`` set. A request that exports early (``Request.export_early``) has
  each chunk exported as soon as a step has computed it (``start_early_export``, its
  blocks pinned while the sequence runs on): a token-less, non-final delta with those
  chunks, then the final delta with the chunks after them;
- import: ``hold_for_import`` pins every block from import until admission
  (``Scheduler._admit`` drops the hold once the prefix match pinned them again), fresh
  blocks become findable only after the worker wrote them (``commit_import``);
- abort: a job is marked cancelled and its blocks go back when the worker lets go of them;
- a worker error fails only its request (``poll`` returns it; the engine ends the request
  with finish_reason "error").

On CUDA the step records an event on the compute stream when it hands a job over; the side
stream waits for it (the KV it reads is written, the blocks it writes are no longer read),
and an import's own event is waited on by the compute stream before the blocks are used.
Tensor-parallel replicas (``inline``) run jobs on the step thread: their cache I/O is a
collective with the worker ranks and must stay ordered with the steps. On CUDA the worker
hands the chunk tags (xxh3) to a second thread that hashes beside its copies; otherwise each
tag is hashed in the same pass as its copy.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from app.engine.block_manager import BlockManager, ImportHold
from app.engine.kv_cache import KVCache
from app.engine.kv_transfer import encode_chunks, plan_import, write_import
from app.engine.request import RequestDelta
from app.engine.sequence import Sequence
from app.kv.chunk_format import ChunkFormat
from app.kv.keys import BlockHash

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class ExportJob:
    request_id: str
    delta: RequestDelta  # the request's final delta (no token), returned with the chunks
    token_ids: list[int]  # the prompt
    block_ids: list[int]  # pinned until the worker has read them
    salt: bytes
    block_hashes: list[BlockHash]  # of the prompt's full blocks (the chunks' keys, digests)
    after: Any = None  # CUDA event: the step that wrote the KV
    cancelled: bool = False
    first: int = 0  # the chunks start at this token (earlier ones were exported early)
    read_from: int = 0  # block_ids[read_from:] hold them (all of block_ids are released)
    final: bool = True  # False: an early export (its delta neither ends nor closes anything)
    delivered: bool = False  # its delta went out from the worker (``Transfers.on_export``)


@dataclass(eq=False, slots=True)
class ImportJob:
    request_id: str
    chunks: list  # KVChunks that continue the prompt (plan_import)
    hold: ImportHold
    after: Any = None  # CUDA event: blocks handed over are no longer read by the step
    cancelled: bool = False


@dataclass(slots=True)
class Polled:
    """What finished since the last poll, for the engine to apply."""

    deltas: list[RequestDelta] = field(default_factory=list)  # exports (chunks or error)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    # (request id, [(chunk key, why)]): imported chunks whose tag failed; recomputed
    rejected: list[tuple[str, list]] = field(default_factory=list)


class Transfers:
    def __init__(
        self,
        blocks: BlockManager,
        cache: KVCache,
        fmt: ChunkFormat,
        device,
        inline: bool,
        idle: threading.Event | None = None,
    ):
        self.blocks, self.cache, self.fmt = blocks, cache, fmt
        self.inline = inline
        self.cuda = torch.device(device).type == "cuda" and not inline
        self.max_held = max(1, blocks.num_blocks // 2)  # imports never pin the whole pool
        self._jobs: dict[str, list] = {}  # request id -> jobs the worker has not finished
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (job, result, error)
        # A job finished, or the engine was woken: shared with the engine's other idle
        # waits (`Engine.wake` sets it once for all).
        self._signal = idle or threading.Event()
        self._thread: threading.Thread | None = None
        self._stream = None
        # GPU replicas hash chunk tags on a second thread beside the worker's copies (xxh3
        # releases the GIL); CPU replicas hash in the same pass as each copy, which measured
        # cheaper there (bench/kv_transfer.py; docs/kv_transfer.md, "What it costs").
        self._tagger: ThreadPoolExecutor | None = None
        # Where the worker hands an export's delta (early or final) at once, from its own
        # thread (set by the AsyncEngine): else it waits for the next step's poll, which
        # comes only after the step running meanwhile (measured: a 1,000-token prompt's
        # early part came after its last step; at 8 streams of long prompts every final
        # delta waited for another prompt's step). The blocks still go back at the poll.
        self.on_export: Callable[[RequestDelta], None] | None = None

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    # --- step thread ----------------------------------------------------------------
    def start_import(self, request_id: str, prompt, chunks, salt: bytes) -> ImportHold | None:
        """Pins the blocks the chunks cover and hands the writes to the worker; the request
        may be admitted once the hold is ready. None: nothing to import."""
        run, hashes = plan_import(self.fmt, request_id, prompt, chunks, salt)
        hold = self.blocks.hold_for_import(hashes, self.max_held)
        if not hold.block_ids:
            return None
        if not hold.fresh and all(c.verified for c in run):  # cached here: only the pin
            self.blocks.commit_import(hold, hold.num_blocks)
            return hold
        self._submit(ImportJob(request_id, run, hold, self._event()))
        return hold

    def start_export(self, seq: Sequence, first: RequestDelta) -> None:
        """Takes seq's blocks; poll returns the request's final delta (``first``'s fields,
        no token: that went out already) with the chunks once they are encoded: those after
        the ones exported early."""
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        bs, start = self.blocks.block_size, seq.num_exported_tokens
        hashes = seq.block_hashes[: len(prompt) // bs]
        block_ids = self.blocks.hand_over(seq)
        final = dataclasses.replace(
            first, new_token_ids=[], text_delta="", logprobs=None, finished=True
        )
        job = ExportJob(seq.request_id, final, prompt, block_ids, seq.salt, hashes, self._event())
        job.first, job.read_from = start, start // bs
        self._submit(job)

    def start_early_export(self, seq: Sequence, upto: int) -> None:
        """Exports seq's computed chunks from its last export up to token ``upto`` (a chunk
        boundary) while it runs on: poll returns a token-less, non-final delta with them."""
        bs, start = self.blocks.block_size, seq.num_exported_tokens
        block_ids = self.blocks.pin_for_export(seq.block_table[start // bs : upto // bs])
        delta = RequestDelta(seq.request_id, seq.index, [], "")
        prompt, hashes = seq.token_ids[:upto], seq.block_hashes[: upto // bs]
        job = ExportJob(seq.request_id, delta, prompt, block_ids, seq.salt, hashes, self._event())
        job.first, job.final = start, False
        seq.num_exported_tokens = upto
        self._submit(job)

    def cancel(self, request_id: str, seqs: list[Sequence]) -> list[RequestDelta]:
        """Abort: pending jobs give their blocks back when the worker is done with them; a
        ready import hold now. Returns the closing deltas of exports in flight."""
        for seq in seqs:
            if seq.kv_hold is not None and seq.kv_hold.ready:
                self.blocks.release_hold(seq.kv_hold)
            seq.kv_hold = None
        closing = []
        for job in self._jobs.get(request_id, []):
            job.cancelled = True
            if isinstance(job, ExportJob) and job.final:
                closing.append(_ended(job.delta, "abort"))
        return closing

    def poll(self) -> Polled:
        """Applies the jobs the worker finished since the last poll."""
        out = Polled()
        while True:
            try:
                job, result, error = self._done.get_nowait()
            except queue.Empty:
                return out
            jobs = self._jobs[job.request_id]
            jobs.remove(job)
            if not jobs:
                del self._jobs[job.request_id]
            if isinstance(job, ExportJob):
                self.blocks.release(job.block_ids)
                if job.cancelled or job.delivered:
                    continue
                if job.final:
                    out.deltas.append(_exported(job.delta, result, error))
                elif error is None:  # a failed early export leaves a gap: recomputed on
                    out.deltas.append(_exported(job.delta, result, None))
            elif job.cancelled or error is not None:
                self.blocks.release_hold(job.hold)
                if not job.cancelled:
                    out.failed.append((job.request_id, f"KV import failed: {error}"))
            else:
                num_valid, rejected, written = result
                if written is not None:  # the compute stream waits for the side stream
                    torch.cuda.current_stream().wait_event(written)
                self.blocks.commit_import(job.hold, num_valid)
                if rejected:
                    out.rejected.append((job.request_id, rejected))

    def wait(self, timeout: float) -> None:
        """Idles until a job finishes, the engine is woken, or timeout: a step with nothing
        to run. Cleared after the wait, so a signal given before it ends it at once (at
        worst one spare step), never lost."""
        if self._done.empty():
            self._signal.wait(timeout)
        self._signal.clear()

    def shutdown(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._todo.put(None)
            thread.join(timeout=5)
        if self._tagger is not None:
            self._tagger.shutdown(wait=False)

    def _event(self):
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()  # on the step's (compute) stream
        return event

    def _submit(self, job) -> None:
        self._jobs.setdefault(job.request_id, []).append(job)
        if self.inline:
            self._done.put((job, *self._run(job)))
            return
        if self._thread is None:
            if self.cuda:
                self._stream = torch.cuda.Stream(self.cache.kv.device)
            if self.cuda:
                self._tagger = ThreadPoolExecutor(1, thread_name_prefix="kv-tag")
            self._thread = threading.Thread(target=self._loop, name="kv-transfer", daemon=True)
            self._thread.start()
        self._todo.put(job)

    # --- worker thread --------------------------------------------------------------
    def _loop(self) -> None:
        while (job := self._todo.get()) is not None:
            result, error = self._run(job)
            if self._deliverable(job, error):
                job.delivered = True  # before the done queue: poll must not send it again
                self.on_export(_exported(job.delta, result, error))
            self._done.put((job, result, error))
            self._signal.set()

    def _deliverable(self, job, error: BaseException | None) -> bool:
        """Whether the worker hands this job's delta out itself (an export, not cancelled;
        a failed early export delivers nothing)."""
        if not isinstance(job, ExportJob) or self.on_export is None or job.cancelled:
            return False
        return job.final or error is None

    def _run(self, job) -> tuple[Any, BaseException | None]:
        """(result, None) or (None, error): never raises, so no job is left hanging."""
        try:
            if self._stream is None:
                return self._work(job), None
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(job.after)
                return self._work(job), None
        except Exception as e:  # noqa: BLE001 - reported to the request, not the engine
            log.exception("KV transfer of request %s failed", job.request_id)
            return None, e

    def _work(self, job):
        if isinstance(job, ExportJob):
            n = len(job.token_ids) - job.first
            kv, scales = self.cache.read_tokens(job.block_ids[job.read_from :], n)
            if kv.device.type != "cpu":  # the chunk payload is host memory
                kv, scales = kv.cpu(), None if scales is None else scales.cpu()
            return encode_chunks(
                self.fmt, job.token_ids, kv, scales, job.salt, self._tagger, job.block_hashes,
                job.first,
            )  # fmt: skip
        num_valid, rejected = write_import(self.cache, self.fmt, job.chunks, job.hold, self._tagger)
        written = None
        if self._stream is not None:
            written = torch.cuda.Event()
            written.record(self._stream)
        return num_valid, rejected, written


def _exported(delta: RequestDelta, chunks, error) -> RequestDelta:
    if error is not None:
        return _ended(delta, "error", f"KV export failed: {error}")
    return dataclasses.replace(delta, exported_chunks=chunks)


def _ended(delta: RequestDelta, reason: str, error: str | None = None) -> RequestDelta:
    """The final delta of an export that did not deliver (``delta``: `start_export`'s,
    finished and without the token, which went out before)."""
    return dataclasses.replace(delta, finish_reason=reason, exported_chunks=None, error=error)
