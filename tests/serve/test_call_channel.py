"""The direct call channel without Ray: the ingress's DirectCaller places calls on a real
CallPort on loopback, which runs the colocated deployment's own `generate_to` over the
stand-in engine and sends the deltas to a real DeltaInbox: the calls' lifecycle (cancel,
either side going away, errors, refusals, draining, the token). Where calls go and how they
share a replica with Serve's calls: test_call_placement.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from app.engine.sampling_params import SamplingParams
from app.serve.call_port import CallPort
from app.serve.call_wire import ReplicaBusy, Submit
from app.serve.colocated import EngineServer
from app.serve.delta_inbox import DeltaInbox
from app.serve.delta_wire import DeltaChannelError, encode_frame
from app.serve.direct_calls import DirectCaller
from app.serve.messages import GenerateRequest, RoutingInfo
from app.serve.port_link import PortLink
from app.serve.slots import Slots
from serve.test_delta_channel import StepEngine, read_all
from serve.test_delta_replicas import _server
from serve.test_router import FakeReplica, router

APP, DEPLOYMENT = "app-test", "EngineServer-test"
FOREVER = 10**9  # tokens: the request only ends when cancelled


class QueueLens:
    """Serve's per-replica count of its own calls, as the router caches it."""

    def __init__(self, **lens: int):
        self.lens = lens

    def get(self, replica_id):
        return self.lens.get(replica_id.unique_id)


def registered_router(replicas: list[FakeReplica], queued: int = 0, **serve_calls: int):
    """The router this process's handle to the deployment would have: its replicas,
    Serve's own calls on each, and ``queued`` requests waiting in its queue."""
    r = router()
    r._deployment_id = SimpleNamespace(app_name=APP, name=DEPLOYMENT)
    r.initialize_state(role="prefill", chunk_tokens=32, deployment=DEPLOYMENT)
    r._replicas = {rep.replica_id: rep for rep in replicas}
    r._replica_queue_len_cache = QueueLens(**serve_calls)
    r._pending_requests_by_id = {f"q{i}": None for i in range(queued)}
    return r


def replica_at(port: CallPort | None, name: str = "a", **stats) -> FakeReplica:
    if port is not None:
        stats["call_port"] = port.address.to_stats()
    return FakeReplica(name, stats)


def gen(rid: str = "r-0", max_tokens: int = 5, tokens: int = 3) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return GenerateRequest(rid, [1] * tokens, params, routing=RoutingInfo(tokens))


async def started_port(target, max_ongoing: int | None = None) -> CallPort:
    """On the target's own slots, or on ``max_ongoing`` new ones."""
    slots = Slots(max_ongoing) if max_ongoing is not None else getattr(target, "slots", Slots(8))
    port = CallPort(target, "127.0.0.1", slots)
    await port.start()
    return port


def no_fallback():
    raise AssertionError("the call went through Serve, not direct")


async def until(predicate, within_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_direct_call_runs_generate_to_and_its_deltas_reach_the_inbox():
    async def main():
        inbox = await DeltaInbox.start()
        server = _server(EngineServer, StepEngine())
        port = await started_port(server)
        registered_router([replica_at(port)])
        caller = DirectCaller(APP, DEPLOYMENT)
        queue = inbox.open("r-0")
        g = gen()
        placed = caller.call("generate_to", g.routing, (g, inbox.reply_to), no_fallback)
        summary = await asyncio.wait_for(placed, 10)
        deltas = await asyncio.wait_for(read_all(queue), 10)
        await until(lambda: caller.ongoing(replica_at(None).replica_id) == 0)
        caller.close()
        await port.stop()
        await inbox.stop()
        return placed.via, summary, deltas, port

    via, summary, deltas, port = asyncio.run(main())
    assert via == "direct" and port.calls == 1 and port.ongoing == 0
    assert summary.num_tokens == 5
    assert [t for d in deltas for t in d.new_token_ids] == [1, 2, 3, 4, 5]


async def streaming_forever():
    """A direct call placed and streaming, which cannot end on its own:
    (inbox, engine, port, caller, placed)."""
    inbox = await DeltaInbox.start()
    engine = StepEngine()
    port = await started_port(_server(EngineServer, engine))
    registered_router([replica_at(port)])
    caller = DirectCaller(APP, DEPLOYMENT)
    queue = inbox.open("r-0")
    g = gen(max_tokens=FOREVER)
    placed = caller.call("generate_to", g.routing, (g, inbox.reply_to), no_fallback)
    await asyncio.wait_for(queue.get(), 10)  # it runs
    return inbox, engine, port, caller, placed


def test_cancelling_a_direct_call_aborts_the_engine_request():
    """Seen failing (the request kept running) with the port ignoring `Cancel`."""

    async def main():
        inbox, engine, port, caller, placed = await streaming_forever()
        placed.cancel()
        await until(lambda: engine.aborted == ["r-0"] and port.ongoing == 0)
        await until(lambda: caller.ongoing(replica_at(None).replica_id) == 0)
        assert port.slots.free == port.slots.total  # nothing leaked on either side
        caller.close()
        await port.stop()
        await inbox.stop()

    asyncio.run(main())


def test_the_ingress_going_away_cancels_its_calls_on_the_replica():
    async def main():
        inbox, engine, port, caller, _ = await streaming_forever()
        caller.close()  # the ingress's connection ends
        await until(lambda: engine.aborted == ["r-0"] and port.ongoing == 0)
        await port.stop()
        await inbox.stop()

    asyncio.run(main())


def test_a_replica_that_goes_away_fails_its_accepted_calls_retriably_without_a_retry():
    """A call the replica accepted may have produced tokens: it fails (503), it is never
    placed a second time through Serve."""

    async def main():
        inbox, _, port, _, placed = await streaming_forever()
        await port.stop()
        with pytest.raises(DeltaChannelError):
            await asyncio.wait_for(placed, 10)
        await inbox.stop()

    asyncio.run(main())


def test_a_busy_or_unreachable_replica_sends_the_call_through_serve():
    """The port refuses when no slot is free (ReplicaBusy); a port nobody listens on
    cannot be connected: both go to the fallback, and release their direct count."""

    async def fallback_result():
        return "through serve"

    async def main(max_ongoing: int, listening: bool):
        server = _server(EngineServer, StepEngine())
        port = await started_port(server, max_ongoing=max_ongoing)
        if not listening:
            await port.stop()
        replica = replica_at(port)
        registered_router([replica])
        caller = DirectCaller(APP, DEPLOYMENT)
        g = gen()
        placed = caller.call("generate_to", g.routing, (g, None), fallback_result)
        result = await asyncio.wait_for(placed, 10)
        ongoing = caller.ongoing(replica.replica_id)
        avoided = caller._choose(g.routing) is None  # an unreachable address is not tried again
        caller.close()
        await port.stop()
        return placed.via, result, ongoing, port.calls, avoided

    busy = asyncio.run(main(max_ongoing=0, listening=True))
    assert busy == ("serve", "through serve", 0, 0, False)
    unreachable = asyncio.run(main(max_ongoing=8, listening=False))
    assert unreachable == ("serve", "through serve", 0, 0, True)


def _explodes_on_load():
    raise RuntimeError("this class does not exist here")


class _Unloadable:
    """Pickles, but cannot be loaded: an answer from a replica of another version."""

    def __reduce__(self):
        return (_explodes_on_load, ())


def test_an_answer_the_ingress_cannot_load_fails_the_link_instead_of_hanging():
    """Seen hanging (the link's reader died, its calls never ended) with the reader
    catching only channel errors."""

    class Target:
        async def run_generate_to(self, *args):
            return _Unloadable()

    async def main():
        port = await started_port(Target())
        link = PortLink(port.address)
        await link.connected()
        call = link.submit("generate_to", ())
        with pytest.raises(DeltaChannelError, match="this class does not exist"):
            await asyncio.wait_for(call.result, 10)
        await port.stop()
        return link.error is not None

    assert asyncio.run(main())


def test_a_call_that_does_not_fit_the_method_takes_no_slot():
    class Target:
        async def run_generate_to(self, g, reply_to):
            return "ok"

    async def main():
        port = await started_port(Target(), max_ongoing=1)
        link = PortLink(port.address)
        await link.connected()
        bad = link.submit("generate_to", (1, 2, 3))  # one argument too many
        with pytest.raises(TypeError):
            await asyncio.wait_for(bad.result, 10)
        good = await asyncio.wait_for(link.submit("generate_to", (1, 2)).result, 10)
        link.close()
        await port.stop()
        return good, port.slots.free

    assert asyncio.run(main()) == ("ok", 1)


def test_a_call_sent_but_never_answered_fails_instead_of_being_placed_again():
    """The connection breaks after the Submit left: the replica may be running it, so it
    is not placed a second time through Serve; it fails with a retriable error."""

    async def swallow(reader, writer):
        await reader.read(1 << 16)  # the token and the Submit: then hang up unanswered
        writer.close()

    async def main():
        server = await asyncio.start_server(swallow, "127.0.0.1", 0)
        port_number = server.sockets[0].getsockname()[1]
        replica = FakeReplica("a", {"call_port": {"host": "127.0.0.1", "port": port_number,
                                                  "token": "00" * 16}})  # fmt: skip
        registered_router([replica])
        caller = DirectCaller(APP, DEPLOYMENT)
        g = gen()
        placed = caller.call("generate_to", g.routing, (g, None), no_fallback)
        try:
            await asyncio.wait_for(placed, 10)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return e, placed.via
        finally:
            caller.close()
            server.close()

    error, via = asyncio.run(main())
    assert isinstance(error, DeltaChannelError) and via == "pending"


def test_a_call_cancelled_on_the_replica_is_answered():
    class Target:
        async def run_generate_to(self, *args):
            raise asyncio.CancelledError  # e.g. the replica shutting its tasks down

    async def main():
        port = await started_port(Target())
        link = PortLink(port.address)
        await link.connected()
        with pytest.raises(DeltaChannelError, match="cancelled on the replica"):
            await asyncio.wait_for(link.submit("generate_to", ()).result, 10)
        link.close()
        await port.stop()

    asyncio.run(main())


def test_a_draining_replica_refuses_new_calls_and_lets_running_ones_end():
    """Serve's graceful shutdown waits only for its own calls; the replica's `__del__`
    drains the direct ones."""

    class Target:
        def __init__(self):
            self.go = asyncio.Event()

        async def run_generate_to(self, *args):
            await self.go.wait()
            return "done"

    async def main():
        target = Target()
        port = await started_port(target)
        link = PortLink(port.address)
        await link.connected()
        running = link.submit("generate_to", ())
        await asyncio.wait_for(running.accepted, 10)
        drained = asyncio.ensure_future(port.drain(10))
        await asyncio.sleep(0.1)
        late = link.submit("generate_to", ())
        with pytest.raises(ReplicaBusy, match="shutting down"):
            await asyncio.wait_for(late.result, 10)
        target.go.set()
        result = await asyncio.wait_for(running.result, 10)
        await asyncio.wait_for(drained, 10)
        return result, port.serving

    assert asyncio.run(main()) == ("done", False)


def test_errors_reach_the_ingress_as_their_own_type():
    class Target:
        async def run_generate_to(self, g, reply_to):
            raise ValueError(f"prompt too long: {len(g.prompt_token_ids)}")

    class Unportable(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}{b}")

    class Broken:
        async def run_generate_to(self, g, reply_to):
            raise Unportable(1, 2)

    async def main(target):
        port = await started_port(target)
        registered_router([replica_at(port)])
        caller = DirectCaller(APP, DEPLOYMENT)
        g = gen()
        try:
            await asyncio.wait_for(
                caller.call("generate_to", g.routing, (g, None), no_fallback), 10
            )
        except Exception as e:  # noqa: BLE001 - the error is the result
            return e
        finally:
            caller.close()
            await port.stop()

    error = asyncio.run(main(Target()))
    assert isinstance(error, ValueError) and "prompt too long: 3" in str(error)
    error = asyncio.run(main(Broken()))  # cannot be unpickled: sent as a RuntimeError
    assert isinstance(error, RuntimeError) and "Unportable" in str(error)


def test_a_connection_without_the_token_is_closed_and_runs_nothing():
    ran = []

    class Target:
        async def run_generate_to(self, *args):
            ran.append(args)

    async def main():
        port = await started_port(Target())
        frame = encode_frame([Submit(0, "generate_to", (1, 2))])
        reader, writer = await asyncio.open_connection("127.0.0.1", port.address.port)
        writer.write(b"x" * 16 + frame)
        got = await asyncio.wait_for(reader.read(), 10)  # EOF: closed unread
        writer.close()
        await port.stop()
        return got

    assert asyncio.run(main()) == b"" and ran == []


def test_only_the_allowed_methods_can_be_called():
    class Target:
        async def run_generate_to(self, *args):
            return "ok"

        async def stats(self):
            raise AssertionError("not a direct method")

    async def main():
        port = await started_port(Target())
        link = PortLink(port.address)
        await link.connected()
        refused = link.submit("stats", ())
        allowed = link.submit("generate_to", ())
        result = await asyncio.wait_for(allowed.result, 10)
        with pytest.raises(PermissionError, match="stats"):
            await asyncio.wait_for(refused.result, 10)
        link.close()
        await port.stop()
        return result, port.calls

    assert asyncio.run(main()) == ("ok", 1)
