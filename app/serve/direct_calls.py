"""Ingress side of the direct call channel (app/serve/call_wire.py): places a choice's unary
calls (colocated `generate_to`; disaggregated `prefill_to` and the decode's `generate_to`)
on an engine replica over one reused TCP connection per replica
(`PortLink`), instead of a Serve handle call (measured: a handle call is entered 2-5 ms
after `.remote()` alone and 7-10 ms in a burst of 8, a direct one 0.4-0.9 ms;
docs/performance.md).

Which replica: the same token cost as the handle's `TokenAwareRouter` (whose replica list
and routing stats, which carry each replica's call address, this reads), plus the tokens
of the direct calls this ingress has in flight there; a routing hint picks the replica of
that index as the router does. The handle call stays the fallback, and is what runs when
no replica advertises an address yet, when no replica has room, when requests already wait
in Serve's queue (they go first), when the connection cannot be opened (the address is
then avoided for `UNREACHABLE_S`), or when the replica answers `ReplicaBusy`; Serve then
queues the call or answers 429, as without this channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.serve.request_router import ReplicaID

from app.serve.call_wire import CallAddress, ReplicaBusy
from app.serve.delta_wire import DeltaChannelError
from app.serve.messages import RoutingInfo
from app.serve.port_link import DirectCall, PortLink
from app.serve.router import TokenAwareRouter
from app.serve.router_registry import router_for

log = logging.getLogger(__name__)
READY_S = 5.0  # at start: routing stats come every routing_stats_period_s (0.5 s default)
UNREACHABLE_S = 30.0  # an address that could not be connected is avoided this long


class PlacedCall:
    """A choice's call, direct or through Serve: awaitable like a `DeploymentResponse`
    (its result), and `cancel()`-able. A call that never reached the replica (no
    connection) or that it refused (`ReplicaBusy`) is placed through ``fallback``; one
    that was sent is never placed twice: if its connection breaks, it fails (503)."""

    def __init__(self, direct: asyncio.Future[DirectCall | None], fallback: Callable[[], Any]):
        self._direct = direct
        self._fallback = fallback
        self._response: Any = None  # the Serve response, once placed through Serve
        self.via = "pending"  # "direct" or "serve" once known (tests, debugging)
        self._placed = asyncio.get_running_loop().create_future()  # a replica took it
        self._task = asyncio.ensure_future(self._run())
        # Its failure is the awaiting driver's to handle; a caller that left must not log it.
        self._task.add_done_callback(self._settle)
        self._placed.add_done_callback(lambda f: f.cancelled() or f.exception())

    def __await__(self):
        return self._task.__await__()

    async def assigned(self) -> None:
        """Returns once a replica took the call (direct: accepted; through Serve: Serve
        assigned it, or a BackPressureError when its queue is full)."""
        await asyncio.shield(self._placed)

    def deliver(self, value: Any) -> bool:
        """Sends ``value`` to the running call on its replica (its `call_mail()`): False if
        the call went through Serve, is not placed yet, or has ended (nothing sent)."""
        if self.via != "direct":
            return False
        return self._direct.result().deliver(value)

    def cancel(self) -> None:
        direct = self._direct
        if not direct.done():
            direct.cancel()
        elif not direct.cancelled() and direct.exception() is None and direct.result():
            direct.result().cancel()
        if self._response is not None:
            self._response.cancel()
        self._task.cancel()

    async def _run(self) -> Any:
        call = await self._direct
        if call is not None:
            try:
                await asyncio.shield(call.accepted)
                self.via = "direct"
                self._placed.set_result(None)
                # Shielded: a cancel of this task must reach the replica as a Cancel frame.
                return await asyncio.shield(call.result)
            except asyncio.CancelledError:
                call.cancel()
                raise
            except ReplicaBusy:
                pass  # refused before it ran: Serve places it
        self.via = "serve"
        self._response = self._fallback()
        placing = asyncio.ensure_future(assigned(self._response))
        placing.add_done_callback(self._settle)
        return await self._response

    def _settle(self, source: asyncio.Future) -> None:
        """``source`` ended (Serve's assignment of the fallback, or the call itself): a
        caller still waiting for the placement learns how."""
        if self._placed.done():
            return
        if source.cancelled():
            self._placed.cancel()
        elif source.exception() is not None:
            self._placed.set_exception(source.exception())
        else:
            self._placed.set_result(None)


class DirectCaller:
    """One per (ingress, deployment): places calls on that deployment's replicas.

    A replica's room is shared with the Serve path: this ingress's direct calls there plus
    Serve's count of its calls stay below `max_ongoing_requests`; the router, told of the
    direct calls (`TokenAwareRouter.direct`), leaves a replica they fill out of its choice,
    so a call that finds no room waits in Serve's queue (or gets 429) as before. Other
    ingresses' direct calls are not seen here: the replica's own `Slots` refuse what does
    not fit (`ReplicaBusy`, then Serve).
    """

    def __init__(self, app: str, deployment: str):
        self.app, self.deployment = app, deployment
        self._links: dict[CallAddress, PortLink] = {}
        self._unreachable: dict[CallAddress, float] = {}  # address -> avoided until
        self._ongoing: dict[ReplicaID, int] = {}  # direct calls in flight, by replica
        self._sent: dict[ReplicaID, int] = {}  # their prompt tokens

    async def ready(self, within_s: float = READY_S) -> bool:
        """Waits (bounded) until some replica advertises its address, so the first requests
        after start go direct too (calls before that go through Serve: nothing breaks)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while loop.time() < deadline:
            router = router_for(self.app, self.deployment)
            if router is not None and any(map(_address, list(router.curr_replicas.values()))):
                return True
            await asyncio.sleep(0.05)
        log.warning("no %s replica advertised a call address in %.1fs", self.deployment, within_s)
        return False

    def ongoing(self, replica_id: ReplicaID) -> int:
        return self._ongoing.get(replica_id, 0)

    def call(self, method: str, routing: RoutingInfo, args: tuple, fallback: Callable[[], Any]):
        """The call ``method(*args)`` (routed by ``routing``), direct when a replica can
        take it, else ``fallback()`` (its Serve handle call)."""
        chosen = self._choose(routing)
        if chosen is None:
            return fallback()
        replica_id, address = chosen
        release = self._reserve(replica_id, routing.num_tokens)
        direct = asyncio.ensure_future(self._submit(self._link(address), method, args, release))
        direct.add_done_callback(lambda t: (t.cancelled() or t.exception()) and release())
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
        except DeltaChannelError:  # logged by the link; the call goes through Serve
            self._unreachable[link.address] = time.monotonic() + UNREACHABLE_S
            release()
            return None
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

    def _choose(self, info: RoutingInfo) -> tuple[ReplicaID, CallAddress] | None:
        router = router_for(self.app, self.deployment)
        if router is None:
            return None
        router.direct = self  # the router counts these calls (see the class docstring)
        if _queued(router) > 0:
            return None  # requests wait in Serve's queue: this one queues behind them
        replicas = list(router.curr_replicas.values())
        if info.hint is not None and replicas:
            ordered = sorted(replicas, key=lambda r: r.replica_id.unique_id)
            replicas = [ordered[info.hint % len(ordered)]]
        best, best_cost = None, 0.0
        for replica in replicas:
            address = _address(replica)
            if address is None or self._avoided(address) or not self._has_room(router, replica):
                continue
            cost = router.cost(replica, info, extra_tokens=self._sent.get(replica.replica_id, 0))
            if best is None or cost < best_cost:
                best, best_cost = (replica.replica_id, address), cost
        return best

    def _has_room(self, router: TokenAwareRouter, replica) -> bool:
        serve_calls = router.replica_queue_len_cache.get(replica.replica_id) or 0
        return self.ongoing(replica.replica_id) + serve_calls < replica.max_ongoing_requests

    def _avoided(self, address: CallAddress) -> bool:
        until = self._unreachable.get(address)
        if until is None:
            return False
        if time.monotonic() < until:
            return True
        del self._unreachable[address]
        return False


async def assigned(response) -> None:
    """Returns once the call (a `PlacedCall` or a Serve `DeploymentResponse`) has a replica;
    raises BackPressureError when the deployment's queue is full. (For a Serve response a
    private Ray API, hence the fallback: without it, admission is decided by the first
    delta instead.)"""
    if isinstance(response, PlacedCall):
        await response.assigned()
        return
    fetch = getattr(response, "_fetch_future_result_async", None)
    if fetch is None:
        return
    try:
        await fetch()
    except asyncio.CancelledError:
        response.cancel()
        raise


def _queued(router: TokenAwareRouter) -> int:
    """Requests waiting in the handle's queue for a replica. Ray's public count
    (`num_pending_requests`) keeps assigned requests until a lazy clean-up, which would
    keep calls off this channel long after the queue emptied; its dict of the waiting ones
    is exact but private, hence the fallback."""
    waiting = getattr(router, "_pending_requests_by_id", None)
    return len(waiting) if isinstance(waiting, dict) else router.num_pending_requests


def _address(replica) -> CallAddress | None:
    stats = replica.routing_stats or {}
    with contextlib.suppress(KeyError, ValueError, TypeError):
        return CallAddress.from_stats(stats.get("call_port"))
    return None
