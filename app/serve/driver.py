"""Drives one normalised request through the engine replicas; shared by both API adapters.

Every call is a Ray Serve handle call (Serve's own transport: its router, its queue and
ongoing-request counts, which the autoscaler reads; by value over gRPC with
RAY_SERVE_THROUGHPUT_OPTIMIZED, docs/serving.md). Colocated: one `EngineServer` stream per
choice. Disaggregated: the `PrefillServer` stream (its first token as soon as the engine
samples it, then its result), then one `DecodeServer` stream for the rest, which takes the
prefill's result from the store's hand-off box; a short prompt (`local_prefill_tokens`)
gets only the `DecodeServer` stream, whose replica prefills it. Cancelling a choice
cancels its calls, whose engines abort the request and free its KV blocks at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from app.engine.request import RequestDelta
from app.kvstore.handoff import HandOffs
from app.serve.api.normalize import EngineInfo, NormalizedRequest
from app.serve.api.responses import (
    Admission,
    AdmissionTicket,
    ChoiceStream,
    choice_deltas,
)
from app.serve.channel.call_deltas import ChoiceCall, inbox_call, stream_call
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.channel.serve_calls import assigned, serve_stream
from app.serve.messages import (
    DONE_REASONS,
    DecodeRequest,
    GenerateRequest,
    HandOff,
    HandOffStarted,
    PrefillResult,
)
from app.serve.metrics import ReplicaMetrics
from app.serve.routing.load_view import LoadView
from app.serve.routing.prefill_placement import (
    PLACEMENTS,
    TTFT_ESTIMATE,
    PlacementConfig,
    PromptLoad,
    place_prefill,
)

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


def _decode_request(gen: GenerateRequest, prefill: HandOff) -> DecodeRequest:
    """The decode call's message; ``prefill``: where its replica takes the prefill's result.
    A routing hint names a prefill replica, so it does not carry over to the decode
    deployment."""
    return DecodeRequest(gen, prefill, dataclasses.replace(gen.routing, hint=None))


class RequestDriver:
    def __init__(
        self,
        metrics: ReplicaMetrics,
        prefill: DeploymentHandle | None = None,
        decode: DeploymentHandle | None = None,
        engine: DeploymentHandle | None = None,
        record_placement: bool = False,
        hand_offs: HandOffs | None = None,
        local_prefill_tokens: int = 0,
        inbox: DeltaInbox | None = None,
        load_view: LoadView | None = None,
        placement_config: PlacementConfig | None = None,
    ):
        assert (engine is None) != (prefill is None and decode is None), "one mode"
        assert prefill is None or hand_offs is not None, "disaggregated hands off in the box"
        self.metrics = metrics
        self.prefill, self.decode, self.engine = prefill, decode, engine
        self.record_placement = record_placement
        # The delta channel's inbox (`delta_channel: socket`): the engine replicas send the
        # deltas of this ingress's choices there; None: they come back as Serve streams
        self.inbox = inbox
        # Disaggregated: the store's hand-off box (app/kvstore/handoff.py), where a prefill's
        # result waits for its decode call, and where this ingress drops one whose decode
        # call will not take it
        self.hand_offs = hand_offs
        # Disaggregated: a prompt of at most this many tokens prefills on its decode replica
        # (ServeArgs.local_prefill_max_tokens); 0: none does
        self.local_prefill_tokens = local_prefill_tokens
        # Disaggregated: the replicas' load and the policy that places each prefill by it
        # (app/serve/routing/prefill_placement.py); None: the prompt-length rule alone
        self.load_view, self.placement_config = load_view, placement_config
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
            deltas = self._one_call(self.engine, gen, admission)
        elif (local := self._local_prefill(gen)) is not None:
            self._record_local(gen)
            deltas = self._one_call(self.decode, local, admission)
        else:
            deltas = self._prefill_then_decode(gen, admission)
        async with contextlib.aclosing(deltas):  # closing us cancels the calls at once
            async for delta in deltas:
                yield delta

    def _local_prefill(self, gen: GenerateRequest) -> DecodeRequest | None:
        """The decode call that prefills the choice's prompt on its decode replica, or None:
        it prefills on a prefill replica. A routing hint names a prefill replica, and a
        limit of 0 sends every prompt there. Otherwise the load-aware policy decides
        (app/serve/routing/prefill_placement.py): a short prompt (it fills no KV chunk, so
        nothing for the store) prefills locally unless the decode replica cannot hold it,
        and a longer one too when its decode replica would give it its first token clearly
        sooner than the prefill replicas' queue (the call then carries the tokens spilled);
        until the replicas have reported their load, the prompt's length alone decides."""
        n = len(gen.prompt_token_ids)
        if gen.routing.hint is not None or self.local_prefill_tokens == 0:
            return None
        view, config = self.load_view, self.placement_config
        if view is None or config is None or not view.known:
            return DecodeRequest(gen, None, gen.routing) if n <= self.local_prefill_tokens else None
        prefill, decode = view.prefill_load(), view.decode_load()
        placement = place_prefill(PromptLoad(n), prefill, decode, config)
        view.placed(placement.where, n)
        self.metrics.inc(PLACEMENTS, 1, **placement.labels)
        self.metrics.observe(TTFT_ESTIMATE, placement.ttft_s, where=placement.where)
        if placement.where == "remote":
            return None
        return DecodeRequest(gen, None, gen.routing, spilled_tokens=placement.spilled_tokens)

    async def _one_call(
        self,
        handle: DeploymentHandle,
        message: GenerateRequest | DecodeRequest,
        admission: AdmissionTicket,
    ) -> AsyncIterator[RequestDelta]:
        """A choice run whole by one call (the colocated engine, or a decode replica that
        prefills the prompt itself)."""
        call = self._generate(handle, message)
        try:
            async for delta in call:
                admission.admit()  # the engine took it (its refusal would come first)
                yield delta
        finally:
            await call.close()

    def _generate(self, handle: DeploymentHandle, message) -> ChoiceCall:
        """The call that runs ``message`` on one of ``handle``'s replicas, and its deltas:
        over the delta channel (a unary `generate_to` through Serve, its deltas sent to
        this ingress's inbox) or as a Serve stream."""
        if self.inbox is None:
            return stream_call(handle.options(stream=True).generate.remote(message))
        request = message.request if isinstance(message, DecodeRequest) else message
        start = lambda reply_to, claim: handle.generate_to.remote(message, reply_to, claim)  # noqa: E731
        return inbox_call(self.inbox, request.request_id, start)

    async def _prefill_then_decode(
        self, gen: GenerateRequest, admission: AdmissionTicket
    ) -> AsyncIterator[RequestDelta]:
        """Disaggregated: the prefill stream gives the first token as soon as its engine
        samples it; unless that token ends the choice, the decode call is placed then (its
        replica waits in the hand-off box for the prefill's result, which the prefill
        replica posts once the prompt's KV is published), and the token goes out once the
        decode call has a replica (a full decode deployment still answers 429 before any
        byte). An overlapped hand-off (a prompt computed over several steps) places the
        decode call earlier, when the prefill stream says its first part is in the box
        (`HandOffStarted`): its replica imports the parts as they are computed, then takes
        the result (the call is cancelled if the token ends the choice). A decode call so
        holds a decode slot only while its prompt is being computed, not while it waits in
        the prefill replica's queue. The prefill's result follows on its stream: a result
        with no chunk refs
        (in-band KV) comes back whole and is posted here. No Ray ref crosses the ingress:
        Serve's by-value transport would pickle it outside Ray, which pins the object."""
        key = HandOff(gen.request_id).key
        prefill = serve_stream(self.prefill.options(stream=True).prefill.remote(gen))
        settled = False  # nothing of this choice can stay in the hand-off box
        call = None  # the decode call, once placed
        try:
            try:
                item = await anext(prefill)
            except BackPressureError:  # refused before any byte: it never runs nor posts
                settled = True
                raise
            if isinstance(item, HandOffStarted):  # its parts are coming: decode imports them
                call = self._generate(self.decode, _decode_request(gen, HandOff(key)))
                item = await anext(prefill)
            first = item.first if isinstance(item, PrefillResult) else item
            if first.finish_reason in DONE_REASONS:  # the replica posts no result (and
                settled = call is None  # discards its parts; so does the early decode call)
                admission.admit()
                yield first
                return
            if call is None:
                call = self._generate(self.decode, _decode_request(gen, HandOff(key)))
            await assigned(call.response)  # before the first token goes out: 429 possible
            admission.admit()
            yield first
            result = item if isinstance(item, PrefillResult) else await anext(prefill)
            async for _ in prefill:  # its end: a stream read to the end needs no cancel
                pass
            self._record(gen, result)
            if not result.posted:
                await self.hand_offs.post(key, result)
            async for delta in call:
                settled = delta.finished
                yield delta
        finally:
            await prefill.aclose()
            if call is not None:  # also when its deltas were never read
                await call.close()
            if not settled:  # ended before its decode call took the result: drop it
                self.hand_offs.discard(key)

    def _record(self, gen: GenerateRequest, result: PrefillResult) -> None:
        """Where the choice's prefill ran."""
        self._note(gen, {
            "prefill_replica": result.replica,
            "store_tokens": result.num_store_tokens,
            "store_failures": result.store_failures,
            "prefill_via": "remote",
            # the prefill replica posted its result to the hand-off box (its KV has chunk
            # refs); False: it came back whole (in-band KV), and the ingress posted it
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
