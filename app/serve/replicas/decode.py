"""DecodeServer: fetch the prompt's KV (verified), continue from the first token, stream.
A short prompt's choice may come without a prefill (`DecodeRequest.prefill` None): this
replica then prefills it too, as a colocated engine does (ServeArgs.local_prefill_max_tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterator

from ray import serve

from app.engine.request import Request, RequestDelta
from app.serve.channel.delta_outbox import stream_to
from app.serve.channel.delta_wire import ReplyTo, StreamSummary
from app.serve.messages import DecodeRequest, HandOff, HandOffPart, PrefillResult
from app.serve.metrics import RequestTimer
from app.serve.replicas.engine_replica import EngineReplica
from app.serve.replicas.hand_off_parts import PartImports, continues
from app.serve.streaming import coalesce

log = logging.getLogger(__name__)


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineReplica):
    role = "decode"
    uses_store = True
    local_prefills = 0  # choices given to this replica to prefill (the metric counts them too)
    hand_off_parts = 0  # parts of overlapped hand-offs taken before their result (fetched)

    async def stats(self) -> dict:
        mine = {"local_prefills": self.local_prefills, "hand_off_parts": self.hand_off_parts}
        return {**await super().stats(), **mine}

    async def generate(self, req: DecodeRequest) -> AsyncIterator[RequestDelta]:
        """Deltas after the first token, streamed back through Serve. The call is placed
        while the prefill still publishes (``req.prefill`` a `HandOff`): it takes the
        prefill's result from the store's hand-off box first. If the prompt's KV cannot be
        fetched or verified, the engine recomputes what is missing: the tokens are the same
        either way."""
        prompt = req.request.prompt_token_ids
        self.host.inflight_tokens += len(prompt)
        try:
            with self._local_prefill(req) as prefilled:
                request = await self._request(req)
                deltas = self._drop_rejected(self.host.async_engine.generate(request))
                # timed: inter-token latency on this replica (and TTFT when it prefilled)
                after_first = req.prefill is not None  # the first token came from prefill
                metrics = self.host.metrics
                timed = metrics.timed(
                    deltas, len(prompt), count=False, after_first_token=after_first
                )
                # Closed explicitly (see EngineServer.generate): a cancel aborts at once.
                async with contextlib.aclosing(coalesce(timed, self.args.stream_interval_s)) as s:
                    async for delta in s:
                        prefilled()
                        yield dataclasses.replace(delta, num_prompt_tokens=len(prompt))
        finally:
            self.host.inflight_tokens -= len(prompt)

    async def generate_to(
        self, req: DecodeRequest, reply_to: ReplyTo, claim: bytes
    ) -> StreamSummary:
        """The same deltas, sent to the ingress's inbox (see EngineServer.generate_to)."""
        prompt = req.request.prompt_token_ids
        link = await self.outbox.link(reply_to)
        link.claim(req.request.request_id, claim)
        after_first = req.prefill is not None  # else the first token is made here
        timer = RequestTimer(self.host.metrics, len(prompt), count=False, after_first=after_first)
        drops: list[asyncio.Task] = []  # store drops of chunks the import rejected
        tokens, completed = 0, False

        def on_delta(delta: RequestDelta) -> None:
            nonlocal tokens
            tokens += len(delta.new_token_ids)
            timer.on_tokens(len(delta.new_token_ids))
            if delta.kv_rejected:
                drops.append(asyncio.ensure_future(self.host.drop_rejected(delta.kv_rejected)))
            link.send(dataclasses.replace(delta, num_prompt_tokens=len(prompt), kv_rejected=None))

        self.host.inflight_tokens += len(prompt)
        try:
            with self._local_prefill(req) as prefilled:
                request = await self._request(req)
                timer.restart()  # from the prefill's result (the first token) on
                sent = lambda delta: (prefilled(), on_delta(delta))  # noqa: E731
                await stream_to(link, self.host.async_engine.run(request, sent))
            completed = True
        finally:
            self.host.inflight_tokens -= len(prompt)
            timer.finish(completed)
            for failure in await asyncio.gather(*drops, return_exceptions=True):
                if isinstance(failure, Exception):
                    log.warning("dropping a rejected chunk from the store failed: %s", failure)
        return StreamSummary(req.request.request_id, tokens)

    @contextlib.contextmanager
    def _local_prefill(self, req: DecodeRequest) -> Iterator[Callable[[], None]]:
        """Counts a choice this replica prefills itself (no prefill result) in its queued
        prefill tokens (`placement_load`) until ``prefilled()`` is called (its first token)
        or the choice ends; the tokens it took from busy prefill replicas
        (`DecodeRequest.spilled_tokens`) as long in its spilled prefill demand (the prefill
        autoscaler's: app/serve/routing/autoscaling.py)."""
        host = self.host
        pending = len(req.request.prompt_token_ids) if req.prefill is None else 0
        spilled = req.spilled_tokens if req.prefill is None else 0
        host.local_prefill_tokens += pending
        host.spilled_prefill_tokens += spilled

        def prefilled() -> None:
            nonlocal pending, spilled
            host.local_prefill_tokens -= pending
            host.spilled_prefill_tokens -= spilled
            pending = spilled = 0

        try:
            yield prefilled
        finally:
            prefilled()

    async def _request(self, req: DecodeRequest) -> Request:
        """The engine request continuing after prefill's first token, with the prompt's KV
        (the prefill's result taken from the hand-off box first); without a prefill, the
        whole choice (its prompt prefilled here)."""
        gen = req.request
        if req.prefill is None:
            self.local_prefills += 1
            self.host.metrics.inc("slimserve:local_prefills", 1)
            return gen.engine_request()
        parts = PartImports(self.host, gen, self._took_part)
        try:
            result = req.prefill
            if isinstance(result, HandOff):
                result = await self._prefill_result(result, parts)
            # The tags are checked by the engine's import, in the same pass as its cache
            # write (app/engine/kv_transfer.py); what it rejects is dropped after.
            fetched, imported = await asyncio.gather(
                self.host.fetch(
                    result.chunks, gen.prompt_token_ids, verify_tag=False,
                    start=result.chunks_start,
                ),
                parts.ready(),
            )  # fmt: skip
        finally:
            parts.cancel()  # done by now, unless this call was cancelled
        kv = imported
        if continues(imported, result.chunks_start):
            kv = imported + fetched.chunks
        first = result.first
        left = gen.params.max_tokens - len(first.new_token_ids)
        return Request(
            gen.request_id,
            gen.prompt_token_ids + first.new_token_ids,
            dataclasses.replace(gen.params, n=1, max_tokens=left),
            cache_salt=gen.cache_salt,
            kv_import=kv or None,
            prior_output_ids=list(first.new_token_ids),  # a grammar replays them
        )

    def _took_part(self) -> None:
        self.hand_off_parts += 1

    async def _prefill_result(self, hand_off: HandOff, parts: PartImports) -> PrefillResult:
        """The prefill's result, taken from the hand-off box (posted there by the prefill
        replica, or by the ingress when its KV is in-band); the parts posted before it (an
        overlapped hand-off) go to ``parts`` as they come. `HandOffLost` (503) when it does
        not come."""
        assert self.hand_offs is not None, "a decode replica uses the store"
        while isinstance(value := await self.hand_offs.take(hand_off.key), HandOffPart):
            parts.add(value)
        return value

    async def _drop_rejected(self, deltas: AsyncIterator[RequestDelta]):
        async with contextlib.aclosing(deltas):  # closing us aborts the engine request now
            async for delta in deltas:
                if delta.kv_rejected:
                    await self.host.drop_rejected(delta.kv_rejected)
                    delta = dataclasses.replace(delta, kv_rejected=None)
                yield delta
