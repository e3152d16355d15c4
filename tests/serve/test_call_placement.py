"""Where the ingress's direct calls go, and how they share a replica with Serve's calls:
the DirectCaller's choice over the real TokenAwareRouter policy on stand-in replicas, the
router leaving replicas that direct calls fill to Serve's queue, and the replica's Slots
(shared `max_ongoing_requests`), and the call address replicas advertise in their routing
stats. Helpers: test_call_channel.py."""

from __future__ import annotations

import asyncio
import pickle

from app.serve.call_port import CallPort
from app.serve.colocated import EngineServer
from app.serve.delta_inbox import DeltaInbox
from app.serve.direct_calls import DirectCaller
from app.serve.messages import RoutingInfo
from app.serve.slots import Slots
from serve.test_call_channel import (
    APP,
    DEPLOYMENT,
    FOREVER,
    gen,
    no_fallback,
    registered_router,
    replica_at,
    started_port,
    until,
)
from serve.test_delta_channel import StepEngine
from serve.test_delta_replicas import _server
from serve.test_router import FakeReplica, choose, pending


def test_requests_waiting_in_serves_queue_go_first():
    """While requests wait in the handle's queue, a new one queues behind them instead of
    taking a slot that frees directly (the queued ones would starve under a steady load)."""

    async def main():
        port = await started_port(_server(EngineServer, StepEngine()))
        registered_router([replica_at(port)], queued=1)
        caller = DirectCaller(APP, DEPLOYMENT)
        chosen = caller._choose(gen().routing)
        registered_router([replica_at(port)], queued=0)
        free = caller._choose(gen().routing)
        await port.stop()
        return chosen, free

    chosen, free = asyncio.run(main())
    assert chosen is None and free is not None


def test_the_chooser_takes_the_cheapest_replica_with_room_and_an_address():
    async def main():
        ports = [await started_port(object()) for _ in range(3)]
        busy = replica_at(ports[0], "a", inflight_tokens=900)
        idle = replica_at(ports[1], "b", inflight_tokens=100)
        silent = FakeReplica("c", {"inflight_tokens": 0})  # no address advertised yet
        registered_router([busy, idle, silent])
        caller = DirectCaller(APP, DEPLOYMENT)
        first = caller._choose(gen(tokens=200).routing)
        registered_router([busy, idle, silent], b=8)  # Serve's own calls fill "b"
        second = caller._choose(gen(tokens=200).routing)
        hinted = caller._choose(RoutingInfo(1, (), 0))
        registered_router([silent])
        none = caller._choose(gen().routing)
        for port in ports:
            await port.stop()
        return first, second, hinted, none

    first, second, hinted, none = asyncio.run(main())
    assert first[0].unique_id == "b" and second[0].unique_id == "a"
    assert hinted[0].unique_id == "a"  # index 0 in replica-id order, as the router does
    assert none is None  # nothing to call directly: the Serve handle places it


def test_the_router_leaves_replicas_filled_by_direct_calls_to_serves_queue():
    """Direct calls and Serve's calls share max_ongoing_requests: the router skips a
    replica the ingress's direct calls fill, and returns nothing (the request waits in
    Serve's queue, or gets 429) when they fill all. Seen failing without the filter, and
    tests/grpc/test_grpc_errors.py's overload test never got its refusal while the empty
    choice spun."""

    class Direct:
        def __init__(self, **n):
            self.n = n

        def ongoing(self, replica_id):
            return self.n.get(replica_id.unique_id, 0)

    a, b = FakeReplica("a", max_ongoing_requests=2), FakeReplica("b", max_ongoing_requests=2)
    r = registered_router([a, b], a=1)
    r.direct = Direct(a=1)  # a: 1 direct + 1 Serve call = full
    chosen = pending(10)
    assert choose(r, [a, b], chosen) == ["b"]
    assert not chosen.routing_context.should_backoff  # a choice was made: no wait
    r.direct = Direct(a=2, b=2)
    waiting = pending(10)
    assert choose(r, [a, b], waiting) == []
    # and Serve backs off before asking again (seen spinning, ~900 choices per 50 ms, with
    # the flag unset: Serve retries at once then)
    assert waiting.routing_context.should_backoff
    r.direct = Direct()
    assert sorted(choose(r, [a, b], pending(10))) == ["a", "b"]


def test_serve_calls_and_direct_calls_share_the_replicas_slots():
    """One slot: while a Serve-placed `generate_to` holds it a direct call is refused
    (and goes through Serve); a Serve call that arrives while a direct call holds it waits
    and runs after. Seen failing (both ran at once) with the Serve method not taking a
    slot."""

    async def main():
        inbox = await DeltaInbox.start()
        engine = StepEngine()
        server = _server(EngineServer, engine)
        server.slots = Slots(1)
        port = await started_port(server)
        registered_router([replica_at(port)])
        caller = DirectCaller(APP, DEPLOYMENT)
        long, short = gen("long", max_tokens=FOREVER), gen("short", max_tokens=3)
        inbox.open("long")
        serve_call = asyncio.ensure_future(server.generate_to(long, inbox.reply_to))
        await until(lambda: "long" in engine.running)

        async def through_serve():
            return "through serve"

        placed = caller.call("generate_to", short.routing, (short, inbox.reply_to), through_serve)
        refused = await asyncio.wait_for(placed, 10), placed.via
        serve_call.cancel()
        await until(lambda: server.slots.free == 1)

        queue = inbox.open("short")
        direct = caller.call("generate_to", long.routing, (long, inbox.reply_to), no_fallback)
        await until(lambda: "long" in engine.running)
        waiting = asyncio.ensure_future(server.generate_to(short, inbox.reply_to))
        await asyncio.sleep(0.2)
        ran_beside = "short" in engine.running or engine.steps and queue.finished
        direct.cancel()
        summary = await asyncio.wait_for(waiting, 10)  # runs once the direct call ended
        caller.close()
        await port.stop()
        await inbox.stop()
        return refused, ran_beside, summary.num_tokens, server.slots.free

    refused, ran_beside, tokens, free = asyncio.run(main())
    assert refused == ("through serve", "serve")
    assert not ran_beside and tokens == 3 and free == 1


def test_slots_go_to_waiting_calls_first_and_a_cancelled_wait_leaks_none():
    async def main():
        slots = Slots(1)
        assert slots.try_take()
        waiter = asyncio.ensure_future(slots.take())
        await asyncio.sleep(0)
        slots.release()  # handed to the waiter, not freed
        grabbed = slots.try_take()
        await waiter
        gone = asyncio.ensure_future(slots.take())
        await asyncio.sleep(0)
        gone.cancel()  # waiting: leaves the queue
        await asyncio.sleep(0)
        slots.release()
        return grabbed, slots.free, slots.try_take()

    assert asyncio.run(main()) == (False, 1, True)


def test_call_addresses_survive_routing_stats_and_keep_the_token_out_of_reprs():
    port = CallPort(object(), "127.0.0.1", Slots(1))
    stats = pickle.loads(pickle.dumps(port.address.to_stats()))  # as Serve ships them
    assert type(port.address).from_stats(stats) == port.address
    assert port.address.token.hex() not in repr(port.address)
    port._sock.close()


def test_a_replicas_slots_follow_serves_max_ongoing_requests(monkeypatch):
    """An operator's config may set a deployment's max_ongoing_requests apart from the app's
    args (deploy/gpu.yaml): the slots follow what Serve runs, else Serve's calls past the
    args' count would wait inside the replica. Seen failing (32) with the slots sized
    from the args. The private field read is checked to exist on Serve's own classes."""
    import dataclasses
    from types import SimpleNamespace

    from ray import serve
    from ray.serve._private.config import DeploymentConfig
    from ray.serve.context import ReplicaContext

    from app.serve.config import ServeArgs
    from app.serve.engine_replica import max_ongoing

    assert "_deployment_config" in {f.name for f in dataclasses.fields(ReplicaContext)}
    assert DeploymentConfig(max_ongoing_requests=7).max_ongoing_requests == 7
    args = ServeArgs()
    assert max_ongoing(args) == args.max_ongoing_requests == 32  # outside a replica
    context = SimpleNamespace(_deployment_config=DeploymentConfig(max_ongoing_requests=256))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    assert max_ongoing(args) == 256


def test_a_call_placed_through_serve_reports_serves_refusal_as_its_placement():
    """A call that goes through Serve (no direct room) is placed when Serve assigns it: its
    queue being full (BackPressureError) reaches whoever waits for the placement, so the
    disaggregated first token is still refused with 429 before any byte. Seen failing
    (assigned() returned) with PlacedCall's placement set when the fallback was made."""
    from ray.serve.exceptions import BackPressureError

    from app.serve.direct_calls import PlacedCall, assigned

    class Refused:  # a Serve response whose deployment's queue is full
        async def _fetch_future_result_async(self):
            raise BackPressureError(num_queued_requests=4, max_queued_requests=4)

        def __await__(self):
            return self._fetch_future_result_async().__await__()

        def cancel(self):
            pass

    async def go():
        no_direct = asyncio.get_running_loop().create_future()
        no_direct.set_result(None)  # no replica could take it directly
        placed = PlacedCall(no_direct, Refused)
        try:
            await assigned(placed)
        except BackPressureError as e:
            return e, placed.via
        return None, placed.via

    error, via = asyncio.run(go())
    assert isinstance(error, BackPressureError) and via == "serve"


def test_slots_follow_a_count_changed_in_place():
    """Serve changes a replica's max_ongoing_requests in place (an operator's edit of that
    option alone: its reconfigure updates the replica context, no restart): the slots read
    it live. Grown, the waiting calls get the new slots at the next take or release; shrunk,
    released slots are not handed out until fewer than the new count are taken. Seen
    failing (the waiter still waiting; a third call let in) with the count read once."""
    limit = [1]

    async def main():
        slots = Slots(lambda: limit[0])
        assert slots.try_take()
        waiter = asyncio.ensure_future(slots.take())
        await asyncio.sleep(0)
        limit[0] = 3  # grown: the waiter gets one at the next take, which gets the third
        grown = slots.try_take(), slots.try_take()
        await asyncio.wait_for(waiter, 1)
        limit[0] = 1  # shrunk: three taken
        slots.release()
        slots.release()
        shrunk = slots.try_take(), slots.free
        slots.release()
        return grown, shrunk, slots.in_use, slots.try_take()

    assert asyncio.run(main()) == ((True, False), (False, 0), 0, True)


def test_a_replicas_slots_read_serves_count_live(monkeypatch):
    """The replica's slots are sized by what its replica context says now (max_ongoing, read
    at each take), not at construction. Seen failing (a call let in past the new count)
    with replica_slots reading the count once."""
    from types import SimpleNamespace

    from ray import serve
    from ray.serve._private.config import DeploymentConfig

    from app.serve.config import ServeArgs
    from app.serve.engine_replica import replica_slots

    config = DeploymentConfig(max_ongoing_requests=2)
    context = SimpleNamespace(_deployment_config=config)
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    slots = replica_slots(ServeArgs())
    assert slots.try_take() and slots.try_take() and not slots.try_take()
    context._deployment_config = DeploymentConfig(max_ongoing_requests=1)  # reconfigured
    slots.release()
    assert not slots.try_take()
    slots.release()
    assert slots.try_take()
