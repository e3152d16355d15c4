"""PrefillServer: store look-up, prompt computation, first token, KV published to the store."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import numpy as np
import ray
from ray import serve

from app.engine.request import Request, RequestDelta, RequestError
from app.kv.chunk import KVChunk
from app.kvstore.store import StoredChunk
from app.kvstore.transfer import publish
from app.serve.messages import (
    DONE_REASONS,
    GenerateRequest,
    HandOff,
    HandOffPart,
    HandOffStarted,
    PrefillResult,
)
from app.serve.replicas.engine_replica import EngineReplica
from app.serve.replicas.hand_off_parts import chunks_end
from app.serve.replicas.replica import is_full
from app.serve.streaming import merge

log = logging.getLogger(__name__)
# Ray passes call arguments up to 100 KiB (its max_direct_call_object_size) in-band and puts
# larger ones in the object store itself: a partial chunk up to this size travels in-band.
INLINE_BYTES = 96 << 10
T = TypeVar("T")


@serve.deployment(name="PrefillServer")
class PrefillServer(EngineReplica):
    role = "prefill"
    uses_store = True

    def __init__(self, args: dict):
        super().__init__(args)
        self._handing_over: set[asyncio.Task] = set()  # may outlive their cancelled call

    async def prefill(
        self, req: GenerateRequest
    ) -> AsyncIterator[HandOffStarted | RequestDelta | PrefillResult]:
        """The prefill as a Serve stream: the first token as soon as the engine samples it
        (before the KV export and the store puts), then the result; before them, an
        overlapped hand-off's `HandOffStarted` once its first part is in the box. A result
        whose KV has chunk refs is posted to the store's hand-off box under the choice's key
        (`HandOff`), for the decode replica, and comes here without them: no Ray ref
        travels back through Serve, whose by-value transport pickles outside Ray (an
        `ObjectRef` pickled so is pinned for its owner's life). One whose KV is in-band
        comes whole (the ingress posts it); one whose token ended the choice comes without
        its chunks (nothing to hand off)."""
        loop = asyncio.get_running_loop()
        token: asyncio.Future[RequestDelta] = loop.create_future()
        started: asyncio.Future[None] = loop.create_future()  # the first part is posted

        async def on_first(first: RequestDelta) -> None:
            token.set_result(first)

        work = asyncio.ensure_future(self._prefill_handed_off(req, on_first, started))
        try:
            await asyncio.wait({token, work, started}, return_when=asyncio.FIRST_COMPLETED)
            if started.done() and not token.done():
                yield HandOffStarted(req.request_id)
                await asyncio.wait({token, work}, return_when=asyncio.FIRST_COMPLETED)
            if token.done():
                yield token.result()
            yield await work
        finally:
            work.cancel()  # done by now unless the caller left; the publish is shielded

    async def _prefill_handed_off(
        self,
        req: GenerateRequest,
        on_first: Callable[[RequestDelta], Awaitable[None]],
        started: asyncio.Future[None] | None = None,
    ) -> PrefillResult:
        result = await self._prefill(req, on_first, started)
        if result.first.finish_reason in DONE_REASONS:  # no decode call: nothing to hand
            if result.chunks_start:  # over (the store keeps its own): parts posted go
                self.hand_offs.discard(HandOff(req.request_id).key)
            return dataclasses.replace(result, chunks=[])
        if result.in_band:
            return result
        assert self.hand_offs is not None, "a prefill replica uses the store"
        await self.hand_offs.post(HandOff(req.request_id).key, result)
        return dataclasses.replace(result, chunks=[], posted=True)

    async def _prefill(
        self,
        req: GenerateRequest,
        on_first: Callable[[RequestDelta], Awaitable[None]] | None = None,
        started: asyncio.Future[None] | None = None,
    ) -> PrefillResult:
        host, prompt = self.host, req.prompt_token_ids
        host.inflight_tokens += len(prompt)
        try:
            fetched, reused = await host.import_from_store(prompt, req.cache_salt)
            request = Request(
                req.request_id,
                prompt,
                dataclasses.replace(req.params, n=1),
                cache_salt=req.cache_salt,
                kv_import=fetched.chunks or None,
                prefill_only=True,
                export_early=self.args.overlap_hand_off,
            )
            deltas = host.metrics.timed(  # timed: TTFT as this replica sees it
                host.async_engine.generate(request), len(prompt), count=False
            )
            parts = _Parts(self, HandOff(req.request_id).key, reused, started)
            try:
                first = await parts.until_token(deltas)  # the token, ahead of the KV export
            except BaseException:
                parts.cancel()
                raise
            work = self._hand_over(first, deltas, parts, on_first)
            first, chunks = await self._shielded(work)
            return PrefillResult(
                req.request_id,
                first,
                chunks,
                host.name,
                num_store_tokens=fetched.num_tokens,
                store_failures=len(fetched.failures),
                chunks_start=parts.end,
            )
        finally:
            host.inflight_tokens -= len(prompt)

    async def _hand_over(
        self,
        first: RequestDelta,
        rest: AsyncIterator[RequestDelta],
        parts: _Parts,
        on_first: Callable[[RequestDelta], Awaitable[None]] | None,
    ) -> tuple[RequestDelta, list[StoredChunk]]:
        """Sends the first token (``on_first``) while the engine exports the prompt's KV,
        then publishes that: -> (the prefill's one delta, its chunks after the parts
        already posted). The engine gives the token before its final delta, which carries
        the chunks (measured 1.5-2 ms of a 64-token prompt's first token here, the export's
        copy and tags); parts exported early may still come before it."""
        async with contextlib.aclosing(rest):
            if on_first is not None:
                await on_first(first)
            try:
                async for delta in rest:
                    if not delta.finished and delta.exported_chunks:
                        parts.add(delta.exported_chunks)
                        continue
                    first = merge(first, delta)
            except RequestError as e:  # the export failed: the token stands; the decode
                # replica gets what came from the store and computes the rest
                log.warning("prefill %s: its KV export failed: %s", first.request_id, e)
                self.host.metrics.inc("slimserve:kv_export_failures", 1)
                await parts.posted()
                reused = parts.reused if not parts.end else []
                return dataclasses.replace(first, finished=True), reused
        assert first.finished, "prefill ended without a final delta"
        exported = first.exported_chunks or []
        first = dataclasses.replace(first, exported_chunks=None)
        chunks, _ = await asyncio.gather(self._publish(exported, parts.reused), parts.posted())
        return first, chunks

    async def _shielded(self, work: Awaitable[T]) -> T:
        """``work`` runs to its end even if this call is cancelled: once the engine has
        computed the prompt, its KV is worth caching for other requests (vLLM keeps an
        aborted request's computed prefix blocks too). The cancel does come after the
        first token: a client that leaves makes the Serve proxy cancel the ingress's call,
        and Ray cancels that call's child tasks recursively, this one among them and the
        store puts it has made. Hence a shield for the coroutine and a fresh context for
        its task: Ray files a call under the task id it finds in a context variable, and
        the recursive cancel follows those ids
        (tests/serve/disaggregated/test_disaggregation.py). The call's slot and in-flight
        tokens are given back at the cancel: the shielded rest (the export's end, the
        publish: a few ms) runs past them."""
        return await asyncio.shield(self._detached(work))

    def _detached(self, work: Awaitable[T]) -> asyncio.Task[T]:
        """``work`` as a task of its own in a fresh context (see `_shielded`), kept by this
        replica until it ends (the loop keeps only a weak reference)."""
        task = asyncio.get_running_loop().create_task(work, context=contextvars.Context())
        self._handing_over.add(task)
        task.add_done_callback(self._handed_over)
        return task

    def _handed_over(self, task: asyncio.Task) -> None:
        self._handing_over.discard(task)
        if not task.cancelled() and task.exception() is not None:  # else never retrieved
            log.warning("publishing a prefill's KV failed: %r", task.exception())

    async def _publish(self, exported: list, reused: list[StoredChunk]) -> list[StoredChunk]:
        """Every exported chunk as a `StoredChunk`: new full chunks are given to the store
        (it owns and caches them); a partial last chunk, which is never cached, travels
        in-band or is put by this replica, which owns it (`in_transit`: no store call)."""
        store, ct = self.host.store, self.host.chunk_tokens
        known = {s.key: s for s in reused}
        fresh = [c for c in exported if c.key not in known]
        new_full = [c for c in fresh if is_full(c, ct)]
        partial_chunks = [c for c in fresh if not is_full(c, ct)]
        full, partial = await asyncio.gather(
            publish(store, new_full, cache=True), all_in_transit(partial_chunks)
        )
        published = full + partial
        self.host.metrics.on_chunks("publish", sum(s.size for s in published))
        self.host.remember(c.key for c in new_full if c.key)
        by_key = {s.key: s for s in published} | known
        run = []  # the leading run the store holds: decode recomputes whatever follows
        for c in exported:
            if (c.key or b"") not in by_key:
                break
            run.append(by_key[c.key or b""])
        return run


class _Parts:
    """A prefill's overlapped hand-off (ServeArgs.overlap_hand_off): each group
    of chunks its engine exported before the end (`Request.export_early`) is published
    and posted to the hand-off box under the result's key as a `HandOffPart`, one after
    another in prompt order, while the engine computes the rest; the result follows them.
    Posts run in a fresh context, as `PrefillServer._shielded`'s work: chunks published
    are worth their post even if the call is cancelled (its ingress then discards the key,
    and the box drops what comes after)."""

    def __init__(
        self,
        server: PrefillServer,
        key: str,
        reused: list[StoredChunk],
        started: asyncio.Future[None] | None = None,  # set once the first part is posted
    ):
        self.server, self.key, self.reused = server, key, reused
        self.started = started
        self.end = 0  # the prompt position after the last part
        self._last: asyncio.Task | None = None  # the latest part's post (they chain)

    async def until_token(self, deltas: AsyncIterator[RequestDelta]) -> RequestDelta:
        """Reads ``deltas`` up to the first token, posting the parts that come before it."""
        async for delta in deltas:
            if delta.new_token_ids or delta.finished or not delta.exported_chunks:
                return delta
            self.add(delta.exported_chunks)
        raise RuntimeError("the prefill ended without a token")

    def add(self, chunks: list[KVChunk]) -> None:
        self.end = chunks_end(chunks)
        self._last = self.server._detached(self._post(self._last, chunks[0].meta.start_pos, chunks))

    async def posted(self) -> None:
        """Every part so far is posted (or failed: its chunks are then recomputed)."""
        if self._last is not None:
            await asyncio.gather(asyncio.shield(self._last), return_exceptions=True)

    def cancel(self) -> None:
        if self._last is not None:
            self._last.cancel()

    async def _post(self, before: asyncio.Task | None, start: int, chunks: list[KVChunk]):
        published = await self.server._publish(chunks, self.reused)
        if before is not None:  # in prompt order
            await asyncio.gather(before, return_exceptions=True)
        await self.server.hand_offs.post(self.key, HandOffPart(start, published), last=False)
        if self.started is not None and not self.started.done():
            self.started.set_result(None)


async def all_in_transit(chunks: list[KVChunk]) -> list[StoredChunk]:
    """`in_transit` of each chunk. A chunk that is put (~2 ms) goes through a worker
    thread, beside the store puts: this replica's event loop serves the other requests'
    first tokens meanwhile (measured at 32 streams: +5-10% tok/s, TTFT p50 -10-25%;
    docs/performance.md). One that travels in-band costs nothing (an exported chunk's
    encode is its own buffer): no thread hop."""
    if all(c.wire is not None and len(c.wire) <= INLINE_BYTES for c in chunks):
        return [in_transit(c) for c in chunks]
    return await asyncio.to_thread(lambda: [in_transit(c) for c in chunks])


def in_transit(chunk: KVChunk) -> StoredChunk:
    """A chunk for one reader (the decode replica), not cached. Up to `INLINE_BYTES` it
    travels in-band, inside the result (which the ingress then delivers to the decode call
    itself, when no chunk has a ref; else the hand-off box passes it on): no object store put
    (~1 ms of this replica's CPU per request, ~9% of it at 8 streams in py-spy) and no
    fetch from its owner on the reader's side. Larger, it goes in the object store, owned
    by this process rather than a store shard (one Ray call less before the first token,
    measured 6.7 -> 2.4 ms at 1 stream): should the object be lost with this replica, the
    reader's fetch fails and it recomputes those tokens, as for any missing chunk
    (tests/serve/disaggregated/test_disaggregation.py kills this replica before the fetch)."""
    data = np.frombuffer(chunk.encode(), dtype=np.uint8)
    payload = data if data.nbytes <= INLINE_BYTES else ray.put(data)
    return StoredChunk(chunk.key or b"", payload, chunk.tag, data.nbytes, chunk.token_ids)
