"""The replicas' generate_to without Ray: the Serve deployment classes' own methods over a
stand-in engine, sending to a real inbox on loopback."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from app.engine.async_engine import AsyncEngine
from app.engine.request import RequestDelta
from app.engine.sampling_params import SamplingParams
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.channel.delta_outbox import DeltaOutbox
from app.serve.config import ServeArgs
from app.serve.messages import DecodeRequest, GenerateRequest, HandOff, PrefillResult
from app.serve.replicas.colocated import EngineServer
from app.serve.replicas.decode import DecodeServer
from app.serve.streaming import merge
from serve.step_engine import StepEngine


class _Box:
    """The hand-off box's client (app/kvstore/handoff.py HandOffs), in memory: what is
    posted and not yet taken, and the keys posted, taken and discarded (in order)."""

    def __init__(self):
        self.posted: dict[str, object] = {}
        self.posts: list[str] = []
        self.takes: list[str] = []
        self.discards: list[str] = []
        self.values: list[tuple[str, object, bool]] = []  # every post: (key, value, last)

    async def post(self, key: str, value: object, last: bool = True) -> None:
        self.values.append((key, value, last))
        self.posts.append(key)
        self.posted[key] = value

    async def take(self, key: str, within_s: float | None = None) -> object:
        self.takes.append(key)
        while key not in self.posted:
            await asyncio.sleep(0.01)
        return self.posted.pop(key)

    def discard(self, key: str) -> None:
        self.discards.append(key)


def _server(cls, engine: StepEngine, box: _Box | None = None):
    server = object.__new__(cls.func_or_class)  # the deployment's class, not started
    server.args = ServeArgs()
    server.outbox = DeltaOutbox()
    server.hand_offs = box or _Box()
    server.host = SimpleNamespace(
        inflight_tokens=0,
        local_prefill_tokens=0,
        spilled_prefill_tokens=0,
        async_engine=AsyncEngine(engine),
        metrics=SimpleNamespace(observe=lambda *a: None, inc=lambda *a: None),
        fetch=lambda chunks, prompt, **kw: _fetched(),
    )
    return server


async def _fetched():
    return SimpleNamespace(chunks=[])


def _calls(max_tokens: int):
    gen = GenerateRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    first = RequestDelta("r-0", 0, [7], "y", finished=True)
    decode = DecodeRequest(gen, PrefillResult("r-0", first, [], "p"))
    handed_off = DecodeRequest(gen, HandOff("k"))

    def take_from_the_box(server, to, claim):
        server.hand_offs.posted["k"] = decode.prefill  # what the prefill replica posted
        return server.generate_to(handed_off, to, claim)

    return [
        (EngineServer, lambda s, to, claim: s.generate_to(gen, to, claim)),
        (DecodeServer, lambda s, to, claim: s.generate_to(decode, to, claim)),
        (DecodeServer, take_from_the_box),
    ]


def test_generate_to_sends_every_delta_then_returns_its_summary():
    """Colocated and decode: the inbox gets the request's tokens in order and its final
    delta; decode's deltas carry the prompt length."""

    async def main(cls, call):
        inbox = await DeltaInbox.start()
        queue = inbox.open("r-0")
        server = _server(cls, StepEngine())
        summary = await call(server, inbox.reply_to, queue.claim)  # final delta written
        got = await asyncio.wait_for(queue.get(), 10)
        while not got.finished:
            got = merge(got, await asyncio.wait_for(queue.get(), 10))
        await inbox.stop()
        return summary, got, server.host.inflight_tokens

    for cls, call in _calls(max_tokens=5):
        summary, got, inflight = asyncio.run(main(cls, call))
        want = 4 if cls is DecodeServer else 5  # decode continues after prefill's token
        assert summary.num_tokens == want and got.new_token_ids == list(range(1, want + 1))
        assert got.finished and got.num_prompt_tokens == (3 if cls is DecodeServer else 0)
        assert inflight == 0


def test_cancelling_generate_to_aborts_the_engine_request():
    """Serve cancels the call when the ingress cancels it: the engine request is aborted
    (its blocks freed), for colocated and decode alike. Seen failing (the stand-in engine
    kept the request running) with stream_to not cancelling the engine run."""

    async def main(cls, call):
        inbox = await DeltaInbox.start()
        queue = inbox.open("r-0")
        engine = StepEngine()
        server = _server(cls, engine)
        task = asyncio.ensure_future(call(server, inbox.reply_to, queue.claim))
        # bounded: a call that fails before its first delta sends none (seen: a 600 s hang)
        first = asyncio.ensure_future(queue.get())
        await asyncio.wait([first, task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            raise AssertionError(task.exception() if task.done() else "no delta in 30 s")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):  # the abort command is applied by the engine loop
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        await inbox.stop()
        return engine, server.host.inflight_tokens

    for cls, call in _calls(max_tokens=100_000):
        engine, inflight = asyncio.run(main(cls, call))
        assert engine.aborted == ["r-0"] and not engine.running, cls
        assert inflight == 0


def test_a_decode_call_placed_before_its_prefill_result_times_gaps_from_that_result():
    """An overlapped hand-off places the decode call with its prefill: its wait for the
    prefill's result (here 0.3 s) is not an inter-token gap. Seen failing (a 0.3 s gap
    recorded) without `RequestTimer.restart` in generate_to."""
    gen = GenerateRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=3))
    first = RequestDelta("r-0", 0, [7], "y", finished=True)

    async def main():
        inbox = await DeltaInbox.start()
        queue = inbox.open("r-0")
        server = _server(DecodeServer, StepEngine())
        gaps = []
        server.host.metrics.observe = lambda name, value: gaps.append((name, value))

        async def post_late():
            await asyncio.sleep(0.3)
            await server.hand_offs.post("k", PrefillResult("r-0", first, [], "p"))

        poster = asyncio.ensure_future(post_late())
        await server.generate_to(DecodeRequest(gen, HandOff("k")), inbox.reply_to, queue.claim)
        await poster
        await inbox.stop()
        return gaps

    gaps = asyncio.run(main())
    itl = [value for name, value in gaps if name == "slimserve:inter_token_latency_seconds"]
    assert len(itl) == 2 and max(itl) < 0.2, gaps
