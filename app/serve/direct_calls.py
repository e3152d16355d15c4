"""Ingress side of the direct call channel (app/serve/call_wire.py): places a colocated
choice's `generate_to` on an engine replica over one reused TCP connection per replica,
instead of a Serve handle call (measured: a handle call is entered ~4.7 ms after
`.remote()` alone and ~10 ms in a burst of 8; docs/performance.md).

Which replica: the same token cost as the handle's `TokenAwareRouter` (whose replica list
and routing stats, which carry each replica's call address, this reads), plus the tokens
of the direct calls this ingress has in flight there; a routing hint picks the replica of
that index as the router does. The handle call stays the fallback, and is what runs when
no replica advertises an address yet, when every replica has `max_ongoing_requests` direct
calls from here, when the connection cannot be opened, or when the replica answers
`ReplicaBusy`; Serve then queues the call or answers 429, as without this channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import ReplicaID

from app.serve.call_wire import Accepted, CallAddress, Cancel, Ended, ReplicaBusy, Submit
from app.serve.delta_wire import DeltaChannelError, encode_frame, read_frame
from app.serve.messages import GenerateRequest
from app.serve.router import TokenAwareRouter
from app.serve.router_registry import router_for

log = logging.getLogger(__name__)
CONNECT_S = 10.0
READY_S = 5.0  # at start: routing stats come every routing_stats_period_s (0.5 s default)


class DirectCall:
    """One call placed on a `PortLink`: `accepted` resolves when the replica took it,
    `result` with its return value (or error)."""

    def __init__(self, link: PortLink, call_id: int):
        loop = asyncio.get_running_loop()
        self.link, self.call_id = link, call_id
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.result: asyncio.Future[Any] = loop.create_future()

    def cancel(self) -> None:
        if not self.result.done():
            self.link.cancel(self.call_id)

    def _settle(self, message: Accepted | Ended) -> None:
        if not self.accepted.done():
            if isinstance(message, Ended) and message.error is not None:
                self.accepted.set_exception(message.error)
            else:
                self.accepted.set_result(None)
        if isinstance(message, Ended) and not self.result.done():
            if message.error is not None:
                self.result.set_exception(message.error)
            else:
                self.result.set_result(message.result)
        # Retrieved here: a caller that stopped waiting must not log "never retrieved".
        for f in (self.accepted, self.result):
            if f.done() and not f.cancelled():
                f.exception()

    def _fail(self, error: BaseException) -> None:
        self._settle(Ended(self.call_id, error=error))


class PortLink:
    """The connection from this ingress to one replica's call port."""

    def __init__(self, address: CallAddress):
        self.address = address
        self.error: DeltaChannelError | None = None  # set once broken; a new link replaces it
        self._ids = itertools.count()
        self._calls: dict[int, DirectCall] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None

    @property
    def ongoing(self) -> int:
        return len(self._calls)

    async def connected(self) -> None:
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        if self.error is not None:
            raise self.error

    def submit(self, method: str, args: tuple[Any, ...]) -> DirectCall:
        """Places the call (the link must be connected); the frame leaves at once."""
        call = DirectCall(self, next(self._ids))
        if self.error is not None:
            call._fail(self.error)
            return call
        self._calls[call.call_id] = call
        call.result.add_done_callback(lambda _: self._calls.pop(call.call_id, None))
        self._write(Submit(call.call_id, method, args))
        return call

    def cancel(self, call_id: int) -> None:
        call = self._calls.pop(call_id, None)
        if call is not None:
            self._write(Cancel(call_id))
            call.result.cancel()

    def close(self) -> None:
        self._break(DeltaChannelError("the call channel was closed by the ingress"))

    def _write(self, message: Submit | Cancel) -> None:
        if self._writer is not None and self.error is None:
            self._writer.write(encode_frame([message]))

    async def _open(self) -> None:
        host, port = self.address.host, self.address.port
        try:
            reader, self._writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), CONNECT_S
            )
        except (OSError, asyncio.TimeoutError) as e:
            error = DeltaChannelError(f"cannot reach the replica's call port {host}:{port}: {e}")
            self._break(error)
            return
        self._writer.write(self.address.token)
        asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        error = DeltaChannelError("the call channel to an engine replica closed")
        try:
            while (frame := await read_frame(reader)) is not None:
                for message in frame:
                    call = self._calls.get(message.call_id)
                    if call is not None:
                        call._settle(message)
        except (DeltaChannelError, ConnectionError) as e:
            error = DeltaChannelError(f"the call channel to an engine replica broke: {e}")
        self._break(error)

    def _break(self, error: DeltaChannelError) -> None:
        if self.error is not None:
            return
        self.error = error
        log.warning("call channel to %s:%d: %s", self.address.host, self.address.port, error)
        for call in list(self._calls.values()):
            call._fail(error)
        self._calls.clear()
        if self._writer is not None:
            self._writer.close()


class PlacedCall:
    """A choice's call, direct or through Serve: awaitable like a `DeploymentResponse`
    (its result), and `cancel()`-able. A direct call the replica refused (`ReplicaBusy`)
    or that could not reach it is placed through ``fallback`` instead; one the replica
    accepted is never placed twice."""

    def __init__(self, direct: asyncio.Future[DirectCall | None], fallback: Callable[[], Any]):
        self._direct = direct
        self._fallback = fallback
        self._response: Any = None  # the Serve response, once placed through Serve
        self.via = "pending"  # "direct" or "serve" once known (tests, debugging)
        self._task = asyncio.ensure_future(self._run())
        # Its failure is the awaiting driver's to handle; a caller that left must not log it.
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        if self._direct.done() and not self._direct.cancelled() and self._direct.result():
            self._direct.result().cancel()
        else:
            self._direct.cancel()
        if self._response is not None:
            self._response.cancel()
        self._task.cancel()

    async def _run(self) -> Any:
        call = await self._direct
        if call is not None:
            try:
                await asyncio.shield(call.accepted)
                self.via = "direct"
                # Shielded: a cancel of this task must reach the replica as a Cancel frame.
                return await asyncio.shield(call.result)
            except asyncio.CancelledError:
                call.cancel()
                raise
            except (ReplicaBusy, DeltaChannelError):
                if call.accepted.done() and call.accepted.exception() is None:
                    raise  # it ran there: a broken channel fails it (retriable 503)
        self.via = "serve"
        self._response = self._fallback()
        return await self._response


class DirectCaller:
    """One per (ingress, deployment): places calls on that deployment's replicas.

    A replica's room is shared with the Serve path: this ingress's direct calls there plus
    Serve's count of its calls stay below `max_ongoing_requests`; the router, told of the
    direct calls (`TokenAwareRouter.direct`), leaves a replica they fill out of its choice,
    so a call that finds no room waits in Serve's queue (or gets 429) as before.
    """

    def __init__(self, deployment: str):
        self.deployment = deployment
        self._links: dict[CallAddress, PortLink] = {}
        self._ongoing: dict[ReplicaID, int] = {}  # direct calls in flight, by replica
        self._sent: dict[ReplicaID, int] = {}  # their prompt tokens

    async def ready(self, within_s: float = READY_S) -> bool:
        """Waits (bounded) until some replica advertises its address, so the first requests
        after start go direct too (calls before that go through Serve: nothing breaks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while loop.time() < deadline:
            router = router_for(self.deployment)
            if router is not None and any(map(_address, list(router.curr_replicas.values()))):
                return True
            await asyncio.sleep(0.05)
        log.warning("no %s replica advertised a call address in %.1fs", self.deployment, within_s)
        return False

    def ongoing(self, replica_id: ReplicaID) -> int:
        return self._ongoing.get(replica_id, 0)

    def call(self, method: str, gen: GenerateRequest, args: tuple, fallback: Callable[[], Any]):
        """``gen``'s call of ``method(*args)``, direct when a replica can take it."""
        chosen = self._choose(gen)
        if chosen is None:
            return fallback()
        replica_id, address = chosen
        release = self._reserve(replica_id, gen.routing.num_tokens)
        direct = asyncio.ensure_future(self._submit(self._link(address), method, args, release))
        direct.add_done_callback(lambda t: t.cancelled() and release())
        return PlacedCall(direct, fallback)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()

    async def _submit(
        self, link: PortLink, method: str, args: tuple, release: Callable[[], None]
    ) -> DirectCall | None:
        try:
            await link.connected()
        except DeltaChannelError:
            release()
            return None  # logged by the link; the call goes through Serve
        call = link.submit(method, args)
        call.result.add_done_callback(lambda _: release())  # refused, ended or cancelled
        return call

    def _reserve(self, replica_id: ReplicaID, tokens: int) -> Callable[[], None]:
        """Counts one direct call on the replica until the returned callable runs (once)."""
        self._count(replica_id, 1, tokens)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._count(replica_id, -1, -tokens)

        return release

    def _count(self, replica_id: ReplicaID, calls: int, tokens: int) -> None:
        self._ongoing[replica_id] = self._ongoing.get(replica_id, 0) + calls
        self._sent[replica_id] = self._sent.get(replica_id, 0) + tokens

    def _link(self, address: CallAddress) -> PortLink:
        link = self._links.get(address)
        if link is None or link.error is not None:
            # Broken links go (a replaced replica listens on a new address).
            self._links = {k: v for k, v in self._links.items() if v.error is None}
            link = self._links[address] = PortLink(address)
        return link

    def _choose(self, gen: GenerateRequest) -> tuple[ReplicaID, CallAddress] | None:
        router = router_for(self.deployment)
        if router is None:
            return None
        router.direct = self  # the router counts these calls (see the class docstring)
        replicas = list(router.curr_replicas.values())
        info = gen.routing
        if info.hint is not None and replicas:
            ordered = sorted(replicas, key=lambda r: r.replica_id.unique_id)
            replicas = [ordered[info.hint % len(ordered)]]
        best, best_cost = None, 0.0
        for replica in replicas:
            address = _address(replica)
            if address is None or not self._has_room(router, replica):
                continue
            cost = router.cost(replica, info, extra_tokens=self._sent.get(replica.replica_id, 0))
            if best is None or cost < best_cost:
                best, best_cost = (replica.replica_id, address), cost
        return best

    def _has_room(self, router: TokenAwareRouter, replica) -> bool:
        serve_calls = router.replica_queue_len_cache.get(replica.replica_id) or 0
        return self.ongoing(replica.replica_id) + serve_calls < replica.max_ongoing_requests


def _address(replica) -> CallAddress | None:
    stats = replica.routing_stats or {}
    with contextlib.suppress(KeyError, ValueError, TypeError):
        return CallAddress.from_stats(stats.get("call_port"))
    return None
