"""The delta channel without Ray: a DeltaInbox and a DeltaOutbox on loopback, fed by the
real AsyncEngine around a stand-in engine (every running request gets one token a step).
The channel's guards against bad peers are in test_delta_security.py."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.request import Request, RequestDelta, TokenLogprob
from app.engine.sampling_params import SamplingParams
from app.serve.channel import delta_codec
from app.serve.channel.delta_codec import decode_deltas, deltas_frames, pack_delta
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.channel.delta_outbox import DeltaOutbox, stream_to
from app.serve.channel.delta_wire import DeltaChannelError, ReplyTo
from serve.step_engine import StepEngine


def request(rid: str, max_tokens: int) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens))


async def read_all(queue) -> list[RequestDelta]:
    """Every delta of one choice, one get() at a time (no merging: the reader keeps up)."""
    out = []
    while not out or not out[-1].finished:
        out.append(await queue.get())
    return out


async def claimed_link(inbox: DeltaInbox, *rids: str, outbox: DeltaOutbox | None = None):
    """A link to ``inbox`` with each of ``rids`` opened there and claimed on the link, as
    the ingress's call and the replica's generate_to do."""
    queues = [inbox.open(rid) for rid in rids]
    link = await (outbox or DeltaOutbox()).link(inbox.reply_to)
    for queue in queues:
        link.claim(queue.request_id, queue.claim)
    return link, queues


def test_a_step_of_n_streams_is_one_frame_and_each_choice_gets_its_tokens_in_order():
    """Eight requests of ten tokens through AsyncEngine.run -> one link -> the inbox: one
    frame per engine step (not one per delta), every choice's tokens in order. Seen failing
    with DeltaLink.send writing each delta at once (80 frames for 10 steps)."""

    async def main():
        inbox = await DeltaInbox.start()
        engine, outbox = StepEngine(), DeltaOutbox()
        async_engine = AsyncEngine(engine)
        rids = [f"e-{i}" for i in range(8)]
        link, queues = await claimed_link(inbox, *rids, outbox=outbox)
        runs = [stream_to(link, async_engine.run(request(r, 10), link.send)) for r in rids]
        got, _ = await asyncio.gather(asyncio.gather(*map(read_all, queues)), asyncio.gather(*runs))
        for rid in rids:
            inbox.close(rid)
        outbox.close()
        await inbox.stop()
        return got, engine.steps, link.frames, inbox.frames

    got, steps, sent, received = asyncio.run(main())
    for deltas in got:
        assert [t for d in deltas for t in d.new_token_ids] == list(range(1, 11))
        assert "".join(d.text_delta for d in deltas) == "".join(f"t{i} " for i in range(1, 11))
    assert steps == 10
    assert sent == received == steps  # one frame per step for all eight streams


FULL = RequestDelta(
    "req-ü-1", 2, [5, 0, 2**31], "héllo\n", True, "stop",
    [TokenLogprob(5, -0.25, ((5, -0.25), (7, -1.5))), TokenLogprob(0, float("-inf"))],
    17, 16, None, "boom",
)  # fmt: skip


def test_every_delta_field_crosses_the_channel_unchanged():
    """A delta with every field set (logprobs with top lists, -inf, non-ASCII text, an
    error) comes out equal, types included (tuples for top). Seen failing with the row
    missing num_cached_tokens (0 after the trip)."""

    async def main():
        inbox = await DeltaInbox.start()
        link, (queue,) = await claimed_link(inbox, FULL.request_id)
        link.send(FULL)
        got = await asyncio.wait_for(queue.get(), 10)
        link.close()
        await inbox.stop()
        return got

    got = asyncio.run(main())
    assert got == FULL
    assert isinstance(got.logprobs[0].top, tuple) and isinstance(got.logprobs[0].top[0], tuple)


def test_deltas_that_must_stay_in_the_replica_are_refused():
    """exported_chunks and kv_rejected are never encoded; over a link such a delta ends its
    own request with an error delta instead of breaking the fan-out or the link."""
    with pytest.raises(ValueError):
        pack_delta(RequestDelta("a", 0, [], "", exported_chunks=[object()]))
    with pytest.raises(ValueError):
        pack_delta(RequestDelta("a", 0, [], "", kv_rejected=[(b"k", "bad tag")]))

    async def main():
        inbox = await DeltaInbox.start()
        link, (queue,) = await claimed_link(inbox, "a")
        link.send(RequestDelta("a", 0, [1], "x", True, "stop", kv_rejected=[(b"k", "why")]))
        got = await asyncio.wait_for(queue.get(), 10)
        link.close()
        await inbox.stop()
        return got, link.error

    got, error = asyncio.run(main())
    assert got.finished and got.finish_reason == "error" and "cannot be sent" in got.error
    assert got.new_token_ids == [] and error.args[0].endswith("closed by the replica")


def test_a_backlog_over_the_frame_limit_is_split_into_frames_in_order(monkeypatch):
    """Deltas coalesced while a link waits for drain can exceed one frame's limit: they
    leave as several frames under it, in order. Seen failing (one frame) without the split
    in deltas_frames."""
    rows = [pack_delta(RequestDelta("a", 0, [i], "x" * 100)) for i in range(50)]
    monkeypatch.setattr(delta_codec, "MAX_ROW_BYTES", 1000)
    frames = deltas_frames(rows)
    assert len(frames) > 5 and all(len(f) <= 1000 + 64 for f in frames)
    got = [d for f in frames for d in decode_deltas(msgpack.unpackb(f[4:]))]
    assert [d.new_token_ids[0] for d in got] == list(range(50))


def test_a_lagging_consumer_gets_the_queued_deltas_merged():
    """Frames that arrived while the consumer was away come out as one delta (fewer SSE
    messages), its tokens and text in order. Seen failing with get() returning one delta."""

    async def main():
        inbox = await DeltaInbox.start()
        link, (queue,) = await claimed_link(inbox, "a")
        for i in range(5):
            link.send(RequestDelta("a", 0, [i], str(i), i == 4, "length" if i == 4 else None))
            await link.drained()
        while not queue.finished:
            await asyncio.sleep(0.01)
        merged = await queue.get()
        link.close()
        await inbox.stop()
        return merged

    merged = asyncio.run(main())
    assert merged.new_token_ids == [0, 1, 2, 3, 4] and merged.text_delta == "01234"
    assert merged.finished and merged.finish_reason == "length"


def test_unknown_and_cancelled_choices_are_dropped_and_nothing_leaks():
    """Deltas of a choice never opened, or closed (cancelled) before they came, are dropped;
    the other choice still gets its own; no queue is left once both are closed. Seen
    failing with _dispatch creating a queue for an unknown id (num_open stayed 1)."""

    async def main():
        inbox = await DeltaInbox.start()
        link, (a, b) = await claimed_link(inbox, "a", "b")
        await link.drained()
        inbox.close("a")  # cancelled
        for rid in ("ghost", "a", "b"):
            link.send(RequestDelta(rid, 0, [1], "x", True, "stop"))
        got = await b.get()
        inbox.close("b")
        link.close()
        await inbox.stop()
        return got, a, inbox.num_open, inbox.rejected

    got, a, num_open, rejected = asyncio.run(main())
    assert got.request_id == "b" and got.new_token_ids == [1]
    assert not a.finished  # the cancelled choice's delta never reached its old queue
    assert num_open == 0 and rejected == 0  # dropped, not counted as another's


def test_a_dropped_connection_fails_its_pending_choices_with_a_retriable_error():
    """The replica side of a connection goes away mid-stream: the choice gets the deltas
    that arrived, then DeltaChannelError (mapped to 503 / UNAVAILABLE). Seen failing (the
    get() hung) with the inbox's closing loop not failing the connection's queues."""

    async def main():
        inbox = await DeltaInbox.start()
        link, (queue,) = await claimed_link(inbox, "a")
        link.send(RequestDelta("a", 0, [1], "x"))
        first = await queue.get()
        link.close()
        with pytest.raises(DeltaChannelError):
            await asyncio.wait_for(queue.get(), 10)
        inbox.close("a")
        await inbox.stop()
        return first

    assert asyncio.run(main()).new_token_ids == [1]


def test_the_ingress_going_away_aborts_the_replicas_engine_requests():
    """When the inbox closes (ingress gone), stream_to raises DeltaChannelError and the
    engine request is aborted (its KV blocks freed), not left generating for nobody.
    Seen failing (hung until the request's 10,000 tokens) without DeltaLink._listen_to."""

    async def main():
        inbox = await DeltaInbox.start()
        engine = StepEngine()
        async_engine = AsyncEngine(engine)
        link, (queue,) = await claimed_link(inbox, "a")
        run = asyncio.ensure_future(
            stream_to(link, async_engine.run(request("a", 10_000), link.send))
        )
        await queue.get()
        await inbox.stop()
        with pytest.raises(DeltaChannelError):
            await asyncio.wait_for(run, 10)
        for _ in range(100):
            if engine.aborted:
                break
            await asyncio.sleep(0.01)
        return engine

    engine = asyncio.run(main())
    assert engine.aborted == ["a"] and not engine.running


def test_an_unreachable_inbox_is_a_channel_error():
    async def main():
        inbox = await DeltaInbox.start()
        reply_to = inbox.reply_to
        await inbox.stop()
        await DeltaOutbox().link(ReplyTo(reply_to.host, reply_to.port, reply_to.secret))

    with pytest.raises(DeltaChannelError, match="cannot reach"):
        asyncio.run(main())


def test_the_secret_stays_out_of_reprs():
    reply_to = ReplyTo("10.0.0.1", 5, b"s" * 32)
    assert "s" * 8 not in repr(reply_to) and "10.0.0.1" in repr(reply_to)


def test_a_broken_link_is_replaced_and_forgotten():
    """After an ingress goes away, the outbox keeps no link to it, and a new inbox (a
    restarted ingress) gets a fresh link. Seen failing (two links kept) without the prune
    in DeltaOutbox.link."""

    async def main():
        outbox = DeltaOutbox()
        old = await DeltaInbox.start()
        link = await outbox.link(old.reply_to)
        await old.stop()
        await asyncio.wait_for(link.until_broken(), 10)
        with pytest.raises(DeltaChannelError):
            await link.drained()
        new = await DeltaInbox.start()
        fresh, (queue,) = await claimed_link(new, "a", outbox=outbox)
        fresh.send(RequestDelta("a", 0, [5], "z", True, "stop"))
        got = await asyncio.wait_for(queue.get(), 10)
        await new.stop()
        return got, list(outbox._links.values()) == [fresh]

    got, only_fresh = asyncio.run(main())
    assert got.new_token_ids == [5] and only_fresh
