"""Drives one normalised request through the engine replicas; shared by both API adapters.

Colocated: one `EngineServer` call per choice. Disaggregated: `prefill` (first token + the
prompt's KV as store chunks), then one `DecodeServer` call for the rest; a short prompt
(`local_prefill_tokens`) gets only the `DecodeServer` call, whose replica prefills it.
With the delta channel (`delta_channel: socket`, an inbox given) that call is the unary,
long-lived `generate_to`, whose deltas arrive through the ingress's `DeltaInbox`, and the
prefill's result reaches it from this ingress or through the store's hand-off box
(app/serve/result_hand_over.py); otherwise it is the Serve stream `generate`. With the
direct call channel (`direct` callers given) these unary calls go over the replicas' call
ports, else through Serve handles. Cancelling a choice cancels the replica call, whose
engine aborts the request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from app.engine.request import RequestDelta
from app.kvstore.handoff import HandOffs
from app.serve.call_deltas import inbox_deltas, serve_stream
from app.serve.delta_inbox import DeltaInbox, DeltaQueue
from app.serve.delta_wire import ReplyTo, head_id
from app.serve.direct_calls import DirectCaller, assigned
from app.serve.messages import DecodeRequest, GenerateRequest, HandOff, PrefillResult, RoutingInfo
from app.serve.metrics import ReplicaMetrics
from app.serve.normalize import EngineInfo, NormalizedRequest
from app.serve.responses import (
    DONE_REASONS,
    Admission,
    AdmissionTicket,
    ChoiceStream,
    choice_deltas,
)
from app.serve.result_hand_over import hand_over, nothing_in_the_box

_PLACEMENTS = 1024  # placements kept for the debug view; streams never collect theirs


async def _refused_on_error(
    deltas: AsyncIterator[RequestDelta], ticket: AdmissionTicket
) -> AsyncIterator[RequestDelta]:
    """A choice that fails (or ends) before it was admitted refuses the request."""
    try:
        async for delta in deltas:
            yield delta
    except Exception as e:
        ticket.refuse(e)
        raise
    finally:
        ticket.refuse(RuntimeError("the choice ended before it was admitted"))


def _decode_request(gen: GenerateRequest, prefill: PrefillResult | HandOff) -> DecodeRequest:
    """The decode call's message; ``prefill``: its result or where to take it. A routing
    hint names a prefill replica, so it does not carry over to the decode deployment."""
    return DecodeRequest(gen, prefill, dataclasses.replace(gen.routing, hint=None))


class RequestDriver:
    def __init__(
        self,
        metrics: ReplicaMetrics,
        prefill: DeploymentHandle | None = None,
        decode: DeploymentHandle | None = None,
        engine: DeploymentHandle | None = None,
        record_placement: bool = False,
        inbox: DeltaInbox | None = None,
        direct: dict[str, DirectCaller] | None = None,
        hand_offs: HandOffs | None = None,
        local_prefill_tokens: int = 0,
    ):
        assert (engine is None) != (prefill is None and decode is None), "one mode"
        assert not direct or inbox is not None, "direct calls send their deltas to an inbox"
        self.metrics = metrics
        self.prefill, self.decode, self.engine = prefill, decode, engine
        self.record_placement = record_placement
        self.inbox = inbox  # None: deltas come back as Serve streams
        # By deployment ("engine", "prefill", "decode"): its unary calls go direct when they
        # can; a deployment not here gets every call through its Serve handle.
        self.direct = direct or {}
        # Disaggregated: the store's hand-off box (app/kvstore/handoff.py), where this
        # ingress posts a prefill's result for a decode call placed through Serve, and drops
        # one whose decode call will not take it; None: neither is needed.
        self.hand_offs = hand_offs
        # Disaggregated: a prompt of at most this many tokens prefills on its decode replica
        # (ServeArgs.local_prefill_max_tokens); 0: none does
        self.local_prefill_tokens = local_prefill_tokens
        self._info: EngineInfo | None = None
        self.placement: dict[str, dict[str, Any]] = {}  # engine request id -> where it ran

    @property
    def handles(self) -> list[DeploymentHandle]:
        return [h for h in (self.prefill, self.decode, self.engine) if h is not None]

    @property
    def generating(self) -> DeploymentHandle:
        """The deployment that holds the running requests (decode or colocated engine)."""
        return self.decode or self.engine  # type: ignore[return-value]

    async def warm_up(self) -> None:
        """Before the first request: each handle's router learns its replicas (measured: the
        first request after start otherwise waited ~0.7 s for this, colocated). Waits for
        the engine replicas to be up, which the first request would wait for anyway.
        Handles made by .options() (streaming) share the router warmed here."""
        await self.describe()
        for handle in self.handles:
            await handle.describe.remote()
        for caller in self.direct.values():
            await caller.ready()

    async def describe(self) -> EngineInfo:
        if self._info is None:
            handle = self.prefill or self.engine
            self._info = EngineInfo.from_describe(await handle.describe.remote())
        return self._info

    async def start(self, req: NormalizedRequest) -> ChoiceStream:
        """The request's choices as one stream (nothing runs until it is first read)."""
        info = await self.describe()
        role = "prefill" if self.prefill is not None else "engine"
        admission = Admission(req.params.n)
        choices = [
            choice_deltas(self._timed(req.choice(i, info, role), admission.ticket()))
            for i in range(req.params.n)
        ]
        return ChoiceStream(choices, admission)

    def placements(self, req: NormalizedRequest) -> list[dict[str, Any] | None]:
        return [self.placement.pop(f"{req.engine_id}-{i}", None) for i in range(req.params.n)]

    def _timed(self, gen: GenerateRequest, ticket: AdmissionTicket) -> AsyncIterator[RequestDelta]:
        """One choice's deltas, timed: TTFT, inter-token and e2e latency, token counts."""
        deltas = _refused_on_error(self._choice_deltas(gen, ticket), ticket)
        return self.metrics.timed(deltas, len(gen.prompt_token_ids))

    async def _choice_deltas(
        self, gen: GenerateRequest, admission: AdmissionTicket
    ) -> AsyncIterator[RequestDelta]:
        if self.engine is not None:
            deltas = self._one_call("engine", gen, gen, admission)
        elif self._prefills_locally(gen):
            self._record_local(gen)
            deltas = self._one_call("decode", gen, DecodeRequest(gen, None, gen.routing), admission)
        elif self.inbox is not None and gen.params.max_tokens > 1:
            deltas = self._decode_during_prefill(gen, admission)
        else:
            deltas = self._prefill_then_decode(gen, admission)
        async with contextlib.aclosing(deltas):  # closing us cancels the calls at once
            async for delta in deltas:
                yield delta

    def _prefills_locally(self, gen: GenerateRequest) -> bool:
        """A short prompt prefills on its decode replica: it fills no KV chunk (nothing for
        the store), so a prefill replica would add only the hand-off. A routing hint names
        a prefill replica: the prompt goes there."""
        short = len(gen.prompt_token_ids) <= self.local_prefill_tokens
        return short and gen.routing.hint is None

    async def _one_call(
        self,
        deployment: str,
        gen: GenerateRequest,
        message: GenerateRequest | DecodeRequest,
        admission: AdmissionTicket,
    ) -> AsyncIterator[RequestDelta]:
        """A choice run whole by one call of ``deployment`` (the colocated engine, or a
        decode replica that prefills the prompt itself)."""
        if self.inbox is not None:
            start = lambda reply_to: self._place(  # noqa: E731
                deployment, "generate_to", gen.routing, (message, reply_to)
            )
            deltas = inbox_deltas(self.inbox, gen.request_id, start, admission)
            async with contextlib.aclosing(deltas):  # closing us cancels the call at once
                async for delta in deltas:
                    yield delta
            return
        handle = getattr(self, deployment)
        async for delta in serve_stream(handle.options(stream=True).generate.remote(message)):
            admission.admit()  # the engine took it (its refusal would come first)
            yield delta

    async def _prefill_then_decode(
        self, gen: GenerateRequest, admission: AdmissionTicket
    ) -> AsyncIterator[RequestDelta]:
        """Disaggregated, one call after the other: the prefill, then (unless its token
        ended the choice) the decode call with its result, streamed through Serve."""
        response = self.prefill.prefill.remote(gen)
        try:
            result = await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        self._record(gen, result)
        if result.first.finish_reason in DONE_REASONS:
            admission.admit()
            yield result.first
            return
        decode = self.decode.options(stream=True).generate.remote(_decode_request(gen, result))
        await assigned(decode)  # before the first token goes out: 429 stays possible
        admission.admit()
        yield result.first
        async for delta in serve_stream(decode):
            yield delta

    def _place(self, deployment: str, method: str, routing: RoutingInfo, args: tuple):
        """``deployment``'s unary ``method(*args)``: direct when one of its replicas can
        take it, else through its Serve handle (awaitable and cancel()-able either way)."""
        handle = getattr(self, deployment)
        serve_call = lambda: getattr(handle, method).remote(*args)  # noqa: E731
        caller = self.direct.get(deployment)
        if caller is None:
            return serve_call()
        return caller.call(method, routing, args, serve_call)

    async def _decode_during_prefill(
        self, gen: GenerateRequest, admission: AdmissionTicket
    ) -> AsyncIterator[RequestDelta]:
        """Disaggregated with the delta channel: the decode call is placed as soon as the
        prefill call has a replica, and waits for the prefill's result itself (`hand_over`:
        delivered by this ingress, or taken from the store's hand-off box); so the first
        token waits for the longer of the prefill and the decode assignment, not for both
        in turn. The prefill replica sends the first token to the inbox ahead of its result
        (`PrefillServer.run_prefill_to`). Neither call's message carries a Ray ref, so
        both may go over the direct call channel."""
        key = head_id(gen.request_id)
        head = self.inbox.open(key)  # before the call: the token cannot be missed
        hand_off = HandOff(gen.request_id)
        # True once nothing of this choice can stay in the hand-off box: its decode call took
        # the result, or the prefill was refused (never runs, never posts)
        settled = False
        handed: asyncio.Future[bool] | None = None  # the result's hand-over, once started
        try:
            prefill = self._place(
                "prefill", "prefill_to", gen.routing, (gen, self.inbox.reply_to, hand_off)
            )
            try:
                await assigned(prefill)  # a refused prefill (429) places no decode call
            except BaseException as e:
                prefill.cancel()
                settled = isinstance(e, BackPressureError)
                raise
            result = asyncio.ensure_future(self._prefilled(gen, prefill))
            result.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen below
            message = _decode_request(gen, hand_off)
            first = asyncio.ensure_future(self._first_token(gen, result, head))
            placed = asyncio.get_running_loop().create_future()  # the decode call
            handed = asyncio.ensure_future(hand_over(result, placed, hand_off.key, self.hand_offs))
            handed.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen below

            def start(reply_to: ReplyTo):
                decode = self._place("decode", "generate_to", message.routing, (message, reply_to))
                placed.set_result(decode)
                return decode

            deltas = inbox_deltas(
                self.inbox, gen.request_id, start, admission, first, handed=handed
            )
            n = 0  # delta 0 is the prefill's token
            try:
                async with contextlib.aclosing(deltas):
                    async for delta in deltas:
                        settled, n = n > 0 and delta.finished, n + 1
                        yield delta
            finally:
                handed.cancel()  # done unless the choice ended before its hand-over
                if not first.done():  # refused (429), cancelled or failed before the token
                    first.cancel()
                    result.cancel()
                    prefill.cancel()
        finally:
            self.inbox.close(key)
            # Its decode call may never take the result (refused, cancelled before the take,
            # or the token ended the choice), and a prefill cancelled late may still have
            # posted it (even while its placement was awaited): it must not stay in the box.
            # Nothing to drop when the hand-over knows it was never posted (in-band).
            unposted = handed is not None and nothing_in_the_box(handed)
            if not settled and not unposted and self.hand_offs is not None:
                self.hand_offs.discard(hand_off.key)

    async def _first_token(
        self, gen: GenerateRequest, result: asyncio.Future[PrefillResult], head: DeltaQueue
    ) -> RequestDelta:
        """The prefill's first token: from the inbox when the replica sent it ahead of its
        result, else from the result (whose failure raises here)."""
        early = asyncio.ensure_future(head.get())
        try:
            await asyncio.wait({result, early}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            early.cancel()
        if early.done() and not early.cancelled() and early.exception() is None:
            # The result lands later (placement recorded then); its failure after the
            # token fails the choice (`inbox_deltas` watches it).
            return dataclasses.replace(early.result(), request_id=gen.request_id)
        return (await result).first

    async def _prefilled(self, gen: GenerateRequest, prefill) -> PrefillResult:
        result = await prefill
        self._record(gen, result, getattr(prefill, "via", "serve"))
        return result

    def _record(self, gen: GenerateRequest, result, via: str = "serve") -> None:
        """Where the choice's prefill ran (``via``: over the direct call channel or Serve)."""
        self._note(gen, {
            "prefill_replica": result.replica,
            "store_tokens": result.num_store_tokens,
            "store_failures": result.store_failures,
            "prefill_via": via,
            # the prefill replica posted its result to the hand-off box (its KV has chunk
            # refs); False: it came back whole (in-band, or the max_tokens 1 path)
            "prefill_posted": result.posted,
        })  # fmt: skip

    def _record_local(self, gen: GenerateRequest) -> None:
        """The choice's prompt prefills on its decode replica (no prefill replica)."""
        self._note(gen, {
            "prefill_replica": None, "store_tokens": 0, "store_failures": 0,
            "prefill_via": "local", "prefill_posted": False,
        })  # fmt: skip

    def _note(self, gen: GenerateRequest, where: dict[str, Any]) -> None:
        if not self.record_placement:
            return
        if len(self.placement) > _PLACEMENTS:
            self.placement.pop(next(iter(self.placement)))
        self.placement[gen.request_id] = where
