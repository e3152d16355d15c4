"""The prefill replica's Serve stream without Ray (`PrefillServer.prefill`): the deployment
class's own code over a stand-in engine; its first token, then its result (posted to an
in-memory hand-off box when its KV has chunk refs)."""

from __future__ import annotations

import asyncio
import functools
import threading
from types import SimpleNamespace

import numpy as np

from app.engine.request import RequestDelta
from app.engine.sampling_params import SamplingParams
from app.kvstore.store import StoredChunk
from app.serve.messages import GenerateRequest, HandOffStarted
from app.serve.metrics import ReplicaMetrics
from app.serve.replicas.prefill import PrefillServer
from serve.step_engine import StepEngine
from serve.test_delta_replicas import _server


def test_prefill_gives_the_first_token_before_publishing_the_kv():
    """Disaggregated: the prefill stream gives the first token as soon as the engine gives
    it, while the KV publish is still running; the result carries the same token. The
    result with the KV's chunk refs goes to the hand-off box under the choice's key, the
    answer to the ingress carries none (Serve's by-value transport must not carry a Ray
    ref). Seen failing (the token timed out) with prefill not passing its sender to
    _prefill, and (chunks in the answer) with the result returned unposted."""

    async def main():
        engine = ExportHeldEngine()
        call, got, release, _ = await _prefill_to_its_head(engine, max_tokens=2)
        engine.exported.set()
        await asyncio.sleep(0.1)
        publishing = not call.done()
        release.set()
        result = await call
        return got, publishing, result, call.server.hand_offs.posted

    got, publishing, result, posted = asyncio.run(main())
    assert publishing and got.request_id == "r-0"
    assert got.new_token_ids == result.first.new_token_ids == [1]
    assert result.first.request_id == "r-0" and result.first.exported_chunks is None
    assert result.chunks == [] and result.posted and posted["r-0"].chunks == [PUBLISHED]
    assert posted["r-0"].first == result.first


def test_a_result_whose_kv_is_in_band_comes_back_whole_not_through_the_box():
    """A result whose chunks all travel in-band (their bytes, no Ray ref: a short prompt's
    partial chunk) comes back whole and is not posted: the ingress posts it for the decode
    call. Seen failing (posted, chunks left out) with every result posted."""
    in_band = _chunk(b"p", np.zeros(8, np.uint8))

    async def main():
        engine = ExportHeldEngine()
        call, _, release, _ = await _prefill_to_its_head(engine, max_tokens=2, chunk=in_band)
        engine.exported.set()
        release.set()
        result = await call
        return result, call.server.hand_offs.posted

    result, posted = asyncio.run(main())
    assert result.chunks == [in_band] and not result.posted and posted == {}
    assert result.first.new_token_ids == [1]


def test_a_result_whose_token_ends_the_choice_comes_without_its_chunk_refs():
    """max_tokens 1: no decode call follows, so nothing is posted, and the result crosses
    Serve's by-value transport without its chunk refs. Seen failing (the refs in the
    answer) with such a result returned whole."""

    async def main():
        call, _, release, _ = await _prefill_to_its_head(max_tokens=1)
        release.set()
        return await call, call.server.hand_offs.posted

    result, posted = asyncio.run(main())
    assert result.first.finish_reason == "length" and result.chunks == [] and posted == {}


def test_prefill_gives_the_first_token_before_the_engine_exports_the_kv():
    """The engine gives a prefill-only request's token before its final delta (the KV
    export, app/engine/transfers.py): the replica sends the token on at once, then waits
    for the export and posts the merged result. Seen failing (head.get() timed out) with
    _prefill collecting every delta before calling on_first."""
    got, exporting, result, server = asyncio.run(_prefill_around_export(ExportHeldEngine()))
    posted = server.hand_offs.posted["r-0"]
    assert exporting and got.new_token_ids == [1] and not got.finished  # the export's is
    assert result.first.new_token_ids == [1] and result.first.finished
    assert posted.first == result.first and posted.chunks == [PUBLISHED]


def test_a_failed_export_after_the_token_hands_over_only_the_stored_prefix():
    """The token went out, then the engine's KV export failed: the prefill still succeeds
    with that token and hands over only the chunks it took from the store (nothing to
    publish), so the decode replica computes the rest (the choice is not failed for a
    cache copy); the failure is counted. Seen failing (the call raised RequestError)
    without the except in _hand_over, and (no count) without its `inc`."""
    engine = ExportHeldEngine(error="KV export failed: disk on fire")
    got, _, result, server = asyncio.run(_prefill_around_export(engine, [STORED]))
    posted = server.hand_offs.posted["r-0"]
    assert got.new_token_ids == result.first.new_token_ids == [1]
    assert result.first.finished and result.first.error is None
    assert posted.first == result.first and posted.chunks == [STORED]
    assert not hasattr(server, "exported")  # no publish
    assert server.host.counted == [("slimserve:kv_export_failures", 1)]


def test_a_successful_export_counts_no_export_failure():
    got, _, result, server = asyncio.run(_prefill_around_export(ExportHeldEngine()))
    assert result.first.new_token_ids == [1] and server.exported == ["c"]
    assert server.host.counted == []


def test_prefill_cancelled_while_the_engine_exports_still_publishes_the_kv():
    """The client leaves after the first token, while the engine is still exporting the
    prompt's KV (Ray cancels the prefill call): the engine request is not aborted, the
    export ends and the KV is published all the same; the call ends cancelled. Seen
    failing (published.wait() timed out, the engine request aborted) with the hand-over
    awaited without `_shielded`."""

    async def main():
        engine = ExportHeldEngine()
        call, _, release, published = await _prefill_to_its_head(engine, max_tokens=2)
        release.set()  # only the engine's export is held here
        call.cancel()  # what Ray's cancel does to the replica's coroutine
        await asyncio.wait({call})
        engine.exported.set()
        await asyncio.wait_for(published.wait(), 10)
        return call, engine.aborted, call.server.exported

    call, aborted, exported = asyncio.run(main())
    assert call.cancelled() and aborted == [] and exported == ["c"]


async def _prefill_around_export(engine: ExportHeldEngine, reused: list | None = None):
    """A `prefill` stream over ``engine`` (publish not held; ``reused``: the chunks the
    store had): -> (its token, whether the stream was still running then, its result, the
    server)."""
    call, got, release, _ = await _prefill_to_its_head(engine, 2, reused)
    release.set()  # only the engine's export is held here
    exporting = not call.done()
    engine.exported.set()
    result = await asyncio.wait_for(call, 10)
    return got, exporting, result, call.server


class ExportHeldEngine(StepEngine):
    """A prefill-only request gets its token (not final), then its final delta, no token,
    once ``exported`` is set: as the engine gives them around its KV export."""

    def __init__(self, error: str | None = None):
        super().__init__()
        self.exported = threading.Event()
        self.error = error  # the export fails with it

    def step(self) -> list[RequestDelta]:
        out = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            if state[1] == 1:
                out.append(RequestDelta(rid, 0, [1], "t1 ", finished=False))
            elif self.exported.wait(0.01):
                chunks = None if self.error else ["c"]
                out.append(RequestDelta(rid, 0, [], "", True, None, exported_chunks=chunks))
                out[-1].error = self.error
                del self.running[rid]
        return out


def test_prefill_cancelled_after_its_first_token_still_publishes_the_kv():
    """A client that leaves after the first token makes Ray cancel the prefill call (a
    child task of the ingress's cancelled call) while the KV is being published: the
    publish runs to its end all the same, and the call still ends cancelled. Seen failing
    (published.wait() timed out) with _prefill awaiting the publish unshielded."""

    async def main():
        call, _, release, published = await _prefill_to_its_head()
        call.cancel()  # what Ray's cancel does to the replica's coroutine
        await asyncio.wait({call})
        release.set()
        await asyncio.wait_for(published.wait(), 10)
        return call

    assert asyncio.run(main()).cancelled()


async def _prefill_to_its_head(
    engine: StepEngine | None = None,
    max_tokens: int = 1,
    reused: list | None = None,
    chunk: object = None,
):
    """A `prefill` stream over ``engine`` (publish held; ``reused``: the chunks the store
    had; ``chunk``: what the publish gives, PUBLISHED if None) read up to its first token:
    -> (a task reading the rest: the result, then the stream's end; that token, release,
    published); the server is ``call.server``."""
    server, release, published = _publish_held(engine, reused, chunk or PUBLISHED)
    gen = GenerateRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    stream = server.prefill(gen)
    got = await asyncio.wait_for(anext(stream), 10)
    call = asyncio.ensure_future(_the_rest(stream))
    call.server = server
    return call, got, release, published


async def _the_rest(stream):
    """The stream's last item (its result), read to the stream's end."""
    items = [item async for item in stream]
    assert len(items) == 1, items
    return items[0]


def _publish_held(
    engine: StepEngine | None = None, reused: list | None = None, chunk: object = None
) -> tuple[object, asyncio.Event, asyncio.Event]:
    """A PrefillServer whose KV publish waits for ``release``, then sets ``published`` and
    gives ``chunk`` (PUBLISHED if None); its metrics' `timed` is the real wrapper (over
    stand-in observe / inc)."""
    server = _server(PrefillServer, engine or StepEngine())
    server.host.name = "p"
    metrics = server.host.metrics
    metrics.timed = functools.partial(ReplicaMetrics.timed, metrics)
    server.host.counted = []  # (name, value) of every `inc`
    metrics.inc = lambda name, value: server.host.counted.append((name, value))
    server.host.import_from_store = lambda prompt, salt: _nothing_stored(reused)
    server._handing_over = set()
    release, published = asyncio.Event(), asyncio.Event()

    async def publish(exported, reused):
        await release.wait()
        server.exported = exported
        published.set()
        return [chunk or PUBLISHED]

    server._publish = publish
    return server, release, published


def _chunk(key: bytes, ref) -> StoredChunk:
    return StoredChunk(key, ref, tag=0, size=8, token_ids=(1, 2, 3))


# A published chunk (its ``ref`` stands in for a Ray ref) and one the store had already
PUBLISHED = _chunk(b"k", "a Ray ref")
STORED = _chunk(b"s", "a Ray ref")


async def _nothing_stored(reused: list | None = None):
    """Nothing fetched; ``reused``: the store's refs (a prefix this replica has locally)."""
    return SimpleNamespace(chunks=[], num_tokens=0, failures=[]), reused or []


def _exported(start: int, n: int = 4) -> SimpleNamespace:
    """An exported chunk as the replica reads it (its prompt position and length)."""
    return SimpleNamespace(meta=SimpleNamespace(start_pos=start, num_tokens=n))


class EarlyExportEngine(StepEngine):
    """A prefill-only request exporting early (`Request.export_early`): a part before the
    token, one after it, then the final delta with the chunks after them."""

    def __init__(self, token_gate: threading.Event | None = None):
        super().__init__()
        self.requests: list = []
        self.token_gate = token_gate  # set: the token's step may run

    def add_request(self, request) -> None:
        self.requests.append(request)
        super().add_request(request)

    def step(self) -> list[RequestDelta]:
        out = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            if state[1] in (1, 3):  # the parts: [0, 4), then [4, 8)
                start = 0 if state[1] == 1 else 4
                out.append(RequestDelta(rid, 0, [], "", exported_chunks=[_exported(start)]))
            elif state[1] == 2:
                if self.token_gate is not None and not self.token_gate.wait(0.01):
                    state[1] -= 1  # not yet: this step again
                    continue
                out.append(RequestDelta(rid, 0, [1], "t1 ", finished=False))
            else:
                final = [_exported(8, 2)]
                out.append(RequestDelta(rid, 0, [], "", True, None, exported_chunks=final))
                del self.running[rid]
        return out


def test_chunks_exported_early_are_posted_as_parts_before_the_result():
    """The overlapped hand-off on the prefill side: each early export (before or after the
    token) is published and posted under the choice's key as a `HandOffPart`, in prompt
    order and not last; the result comes after them, with only the final chunks and
    `chunks_start` after the parts. Seen failing (one post, the result) with the early
    deltas merged into the result as before."""

    async def main():
        engine = EarlyExportEngine()
        call, got, release, _ = await _prefill_to_its_head(engine, max_tokens=2)
        release.set()
        result = await asyncio.wait_for(call, 10)
        return engine.requests[0], got, result, call.server

    request, got, result, server = asyncio.run(main())
    assert request.export_early and got.new_token_ids == [1]
    values = server.hand_offs.values
    assert [(key, last) for key, _, last in values] == [("r-0", False)] * 2 + [("r-0", True)]
    parts = [value for _, value, _ in values[:2]]
    assert [(p.start, p.chunks) for p in parts] == [(0, [PUBLISHED]), (4, [PUBLISHED])]
    assert values[2][1].chunks == [PUBLISHED] and values[2][1].chunks_start == 8
    assert result.posted and result.chunks_start == 8


def test_the_stream_says_the_hand_off_started_before_the_token():
    """Once the first part is in the box (the prompt still being computed), the stream's
    first item is `HandOffStarted`, so the ingress places the decode call then; the token
    and the result follow. Seen failing (the token came first, after the gate) with the
    stream not waiting on the first post."""
    gate = threading.Event()

    async def main():
        server, release, _ = _publish_held(EarlyExportEngine(gate))
        release.set()
        gen = GenerateRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=2))
        stream = server.prefill(gen)
        head = await asyncio.wait_for(anext(stream), 10)  # the token's step is held
        gate.set()
        return head, [item async for item in stream]

    head, rest = asyncio.run(main())
    assert head == HandOffStarted("r-0")
    assert rest[0].new_token_ids == [1] and rest[1].posted and rest[1].chunks_start == 8
