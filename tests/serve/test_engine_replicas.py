"""Engine replica streams without Ray: closing a replica's generator aborts its engine
request at once (fake engine and host; the Serve deployment classes' own methods)."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

from app.engine.request import RequestDelta
from app.engine.sampling_params import SamplingParams
from app.serve.messages import DecodeRequest, GenerateRequest, PrefillResult
from app.serve.replicas.colocated import EngineServer
from app.serve.replicas.decode import DecodeServer


class EndlessEngine:
    """AsyncEngine.generate stand-in: a delta per step until closed, which is the abort."""

    def __init__(self):
        self.aborted: list[str] = []

    async def generate(self, request):
        try:
            for i in itertools.count():
                await asyncio.sleep(0)
                yield RequestDelta(request.request_id, 0, [i], "x")
        finally:
            self.aborted.append(request.request_id)


async def _passthrough(deltas, *args, **kw):
    async for d in deltas:
        yield d


def _server(cls, engine: EndlessEngine):
    server = object.__new__(cls.func_or_class)  # the deployment's class, not started
    server.args = SimpleNamespace(stream_interval_s=0.0)
    server.host = SimpleNamespace(
        inflight_tokens=0,
        local_prefill_tokens=0,
        spilled_prefill_tokens=0,
        async_engine=engine,
        metrics=SimpleNamespace(timed=_passthrough, inc=lambda *a, **kw: None),
        fetch=lambda chunks, prompt, **kw: _fetched(),
    )
    return server


async def _fetched():
    return SimpleNamespace(chunks=[])


def test_closing_a_replica_stream_aborts_the_engine_request_at_once():
    """Serve closes (or drops) a replica's generator when its caller cancels. Seen failing
    without the explicit aclosing in EngineServer/DecodeServer.generate: right after
    aclose() the engine request was still running (its close waited for the garbage
    collector's finalizer task), for colocated and decode alike."""
    gen = GenerateRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=1000))
    first = RequestDelta("r-0", 0, [7], "y", finished=True)
    decode = DecodeRequest(gen, PrefillResult("r-0", first, [], "p"))
    calls = [
        (EngineServer, lambda s: s.generate(gen)),
        (DecodeServer, lambda s: s.generate(decode)),
    ]

    async def main(cls, call) -> None:
        engine = EndlessEngine()
        server = _server(cls, engine)
        stream = call(server)
        assert (await stream.__anext__()).request_id == "r-0"
        await stream.aclose()
        assert engine.aborted == ["r-0"], cls  # no loop turn in between
        assert server.host.inflight_tokens == 0

    for cls, call in calls:
        asyncio.run(main(cls, call))


class GatedEngine(EndlessEngine):
    """Its first delta (the first token) waits for ``gate``."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    async def generate(self, request):
        await self.gate.wait()
        async for delta in super().generate(request):
            yield delta


def test_a_decode_replica_reports_the_spilled_demand_it_took_until_the_first_token():
    """A choice the decode replica prefills counts in its queued prefill tokens, and the
    tokens it took from busy prefill replicas (`DecodeRequest.spilled_tokens`) in its
    spilled demand (what the prefill autoscaler must see: app/serve/routing/load_view.py),
    both until its first token, or until the choice fails. Seen failing (-600 after the
    first token) with the spilled tokens not added in `_local_prefill`."""

    async def main(spilled: int) -> tuple[int, int]:
        engine = GatedEngine()
        server = _server(DecodeServer, engine)
        gen = GenerateRequest("r-0", list(range(4, 604)), SamplingParams(max_tokens=100))
        stream = server.generate(DecodeRequest(gen, None, spilled_tokens=spilled))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        host = server.host
        waiting = (host.local_prefill_tokens, host.spilled_prefill_tokens)
        engine.gate.set()
        await first
        assert (host.local_prefill_tokens, host.spilled_prefill_tokens) == (0, 0)
        await stream.aclose()
        return waiting

    assert asyncio.run(main(600)) == (600, 600)
    assert asyncio.run(main(0)) == (600, 0)  # local for another reason: no demand


def test_a_failed_local_prefill_leaves_nothing_counted():
    """The counts are given back when the choice fails before its first token (the
    `generate_to` path uses the same context). Seen failing with the `finally` removed."""
    server = _server(DecodeServer, EndlessEngine())
    gen = GenerateRequest("r-0", list(range(4, 604)), SamplingParams(max_tokens=100))
    try:
        with server._local_prefill(DecodeRequest(gen, None, spilled_tokens=600)):
            assert (server.host.local_prefill_tokens, server.host.spilled_prefill_tokens) == (
                600,
                600,
            )
            raise RuntimeError("the engine failed")
    except RuntimeError:
        pass
    assert (server.host.local_prefill_tokens, server.host.spilled_prefill_tokens) == (0, 0)
