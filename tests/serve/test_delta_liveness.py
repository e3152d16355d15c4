"""The delta channel's liveness and bounds, on loopback without Ray: heartbeats keep idle
links up, a silent peer is dropped at the deadline, a reader that never reads breaks the
link at the hard cap, a slow one gets every delta in order. Each test's docstring says how
the guard it covers was seen failing."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest

from app.engine.request import RequestDelta
from app.serve.channel.delta_auth import challenge_replica
from app.serve.channel.delta_codec import pack_delta
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.channel.delta_outbox import DeltaOutbox, stream_to
from app.serve.channel.delta_wire import (
    ChannelLimits,
    DeltaChannelError,
    ReplyTo,
    frame_of,
    pack_frame,
)
from serve.delta_peers import FAST, authenticated, still_serves


def test_idle_links_stay_up_on_heartbeats():
    """Nothing but pings for six deadlines: neither side breaks. Seen failing (the link
    broke after 0.3 s) with Heartbeat never writing its ping."""

    async def main():
        inbox = await DeltaInbox.start(limits=FAST)
        outbox = DeltaOutbox(limits=FAST)
        link = await outbox.link(inbox.reply_to)
        await asyncio.sleep(6 * FAST.deadline_s)
        alive = link.error is None and len(inbox._peers) == 1
        served = await still_serves(inbox, "a", outbox)
        await inbox.stop()
        return alive, served

    assert asyncio.run(main()) == (True, True)


def test_a_silent_replica_fails_the_choices_it_carries():
    """An authenticated replica that sends a delta, then nothing (not even pings): past
    the deadline its choices fail with the retriable error. Seen failing (get() hung to
    the test's timeout) with Heartbeat never checking heard_at."""

    async def main():
        inbox = await DeltaInbox.start(limits=FAST)
        queue = inbox.open("a")
        _, writer = await authenticated(inbox)
        writer.write(pack_frame(["claim", "a", queue.claim]))
        writer.write(frame_of(b"\x92\xa6deltas\x91" + pack_delta(RequestDelta("a", 0, [1], "x"))))
        first = await asyncio.wait_for(queue.get(), 5)
        with pytest.raises(DeltaChannelError, match="silent"):
            await asyncio.wait_for(queue.get(), 5)
        writer.close()
        await inbox.stop()
        return first

    assert asyncio.run(main()).new_token_ids == [1]


async def _inbox_stand_in(secret: bytes, then):
    """A server that passes the handshake with ``secret`` and then runs ``then(reader,
    writer)``: a silent ingress, or one that never reads."""

    async def serve(reader, writer):
        await challenge_replica(reader, writer, secret)
        await then(reader, writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, ReplyTo("127.0.0.1", server.sockets[0].getsockname()[1], secret)


def test_a_silent_ingress_breaks_the_link_and_aborts_its_requests():
    """Seen failing (stream_to hung to the test's timeout) with the link's Heartbeat given
    no on_dead."""

    async def main():
        server, reply_to = await _inbox_stand_in(secrets.token_bytes(32), _sleep)
        link = await DeltaOutbox(limits=FAST).link(reply_to)
        link.claim("a", secrets.token_bytes(16))
        with pytest.raises(DeltaChannelError, match="silent"):
            await asyncio.wait_for(stream_to(link, asyncio.sleep(30)), 5)
        server.close()

    asyncio.run(main())


async def _sleep(reader, writer):
    """Neither reads nor writes until the test ends."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(30)


def test_a_reader_that_never_reads_breaks_the_link_at_the_hard_cap():
    """The ingress stops reading: the link writes until high_water, then holds the rest
    (coalesced, no frame per send) and breaks once more than hard_cap bytes wait; memory
    never goes far past the cap. Seen failing: without the cap check stream_to ran all
    2,000 sends (128 MiB buffered); without the hold, frames grew by one per send."""
    limits = ChannelLimits(high_water=256 << 10, hard_cap=2 << 20)

    async def main():
        server, reply_to = await _inbox_stand_in(secrets.token_bytes(32), _sleep)
        link = await DeltaOutbox(limits=limits).link(reply_to)
        peak, frames_at_hold = 0, None

        async def run():
            nonlocal peak, frames_at_hold
            for i in range(2_000):
                link.send(RequestDelta("a", 0, [i], "x" * (64 << 10)))
                await asyncio.sleep(0)
                if link.error is None:
                    buffered = link._writer.transport.get_write_buffer_size() + link._held
                    peak = max(peak, buffered)
                    if link._draining is not None and frames_at_hold is None:
                        frames_at_hold = link.frames
            await asyncio.sleep(30)

        with pytest.raises(DeltaChannelError, match="too slowly"):
            await asyncio.wait_for(stream_to(link, run()), 10)
        server.close()
        return peak, frames_at_hold, link.frames

    peak, frames_at_hold, frames = asyncio.run(main())
    assert peak <= limits.hard_cap + (128 << 10)
    assert frames_at_hold is not None and frames == frames_at_hold  # held, not written


def test_a_slow_reader_gets_every_delta_in_order_through_the_hold():
    """A burst well past high_water: the held deltas leave coalesced once drained (fewer
    frames than sends), all of them in order. Seen failing (lost deltas) with _drain not
    flushing what it held."""
    limits = ChannelLimits(high_water=32 << 10)

    async def main():
        inbox = await DeltaInbox.start()
        link = await DeltaOutbox(limits=limits).link(inbox.reply_to)
        queue = inbox.open("a")
        link.claim("a", queue.claim)
        for i in range(600):  # 20 MB, 640 KB a turn: the inbox reads 256 KB a turn
            last = i == 599
            link.send(RequestDelta("a", 0, [i], "y" * (32 << 10), last, "length" if last else None))
            if i % 20 == 19:
                await asyncio.sleep(0)
        await link.drained()
        got = []
        while not queue.finished or got[-1:] and not got[-1].finished:
            got.append(await asyncio.wait_for(queue.get(), 5))
        link.close()
        await inbox.stop()
        return [t for d in got for t in d.new_token_ids], link.frames

    tokens, frames = asyncio.run(main())
    assert tokens == list(range(600)) and frames < 30
