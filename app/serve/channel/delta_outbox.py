"""Replica side of the delta channel: one lazily opened, reused connection per ingress
inbox (`ReplyTo`), and one frame per event-loop turn.

The AsyncEngine hands a step's deltas to their requests' sinks synchronously, in one
fan-out (`AsyncEngine.run`); `send` packs the delta, appends it to the link's buffer and
schedules one flush with `call_soon`, which runs after that fan-out. So every delta of one
engine step that goes to one ingress leaves in one frame (one write), whatever the number
of streams.

Memory per link is bounded: past ChannelLimits.high_water bytes in the transport's buffer
the link stops writing, awaits drain in a task, and coalesces later deltas in its buffer
(they leave as one frame once drained); past hard_cap bytes written-but-unsent plus held,
the link breaks and its requests abort (`stream_to`), so a slow ingress costs only its own
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
from collections.abc import Awaitable

from app.engine.request import RequestDelta
from app.serve.channel.delta_auth import answer_ingress, tls_contexts
from app.serve.channel.delta_codec import decode_ping, deltas_frames, pack_delta
from app.serve.channel.delta_wire import (
    HANDSHAKE_FRAME_BYTES,
    LIMITS,
    ChannelLimits,
    DeltaChannelError,
    Heartbeat,
    ReplyTo,
    keep_alive,
    pack_frame,
    read_message,
)

log = logging.getLogger(__name__)


class DeltaLink:
    """The connection to one ingress inbox, shared by every request that replies there."""

    def __init__(self, reply_to: ReplyTo, limits: ChannelLimits, tls: ssl.SSLContext | None):
        self.reply_to, self._limits, self._tls = reply_to, limits, tls
        self.frames = 0  # deltas frames written (tests, debugging)
        self.error: DeltaChannelError | None = None  # set once broken; a new link replaces it
        self._claims: list[bytes] = []  # claim frames not yet written
        self._rows: list[bytes] = []  # packed deltas not yet written
        self._held = 0  # bytes in _claims and _rows
        self._flush_scheduled = False
        self._draining: asyncio.Task | None = None  # awaiting drain past the high-water mark
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None
        self._listen: asyncio.Task | None = None
        self._heartbeat: Heartbeat | None = None
        self._broken: asyncio.Future | None = None  # result: the error, once broken

    async def connected(self) -> None:
        """Opens and authenticates the connection on first use (shared by callers)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        if self.error is not None:
            raise self.error

    def claim(self, request_id: str, claim: bytes) -> None:
        """Before ``request_id``'s first delta: the claim its call carried, which binds the
        request id to this connection at the inbox."""
        if self.error is not None:
            raise self.error
        frame = pack_frame(["claim", request_id, claim])
        self._claims.append(frame)
        self._held += len(frame)
        self._schedule_flush()

    def send(self, delta: RequestDelta) -> None:
        """Never raises (it runs inside the engine's fan-out); a delta that cannot travel
        ends its request with an error instead."""
        if self.error is not None:
            return  # stream_to raises the link's error
        try:
            row = pack_delta(delta)
        except (ValueError, TypeError) as e:
            log.error("delta channel: request %s: unsendable delta: %s", delta.request_id, e)
            row = pack_delta(_failed(delta, f"its delta cannot be sent: {e}"))
        self._rows.append(row)
        self._held += len(row)
        self._schedule_flush()

    async def drained(self) -> None:
        """Returns once everything sent so far is handed to the transport and its buffer
        is under the high-water mark; raises the link's error if it broke."""
        while self.error is None and (self._flush_scheduled or self._draining is not None):
            if self._draining is not None:
                await asyncio.wait({self._draining})
            else:
                await asyncio.sleep(0)
        if self.error is None and self._writer is not None:
            try:
                await self._writer.drain()
            except ConnectionError as e:
                self._break(DeltaChannelError(f"the delta channel broke: {e}"))
        if self.error is not None:
            raise self.error

    async def until_broken(self) -> DeltaChannelError:
        assert self._broken is not None, "connected() first"
        return await asyncio.shield(self._broken)

    def close(self) -> None:
        self._break(DeltaChannelError("the delta channel was closed by the replica"), False)

    async def _open(self) -> None:
        self._broken = asyncio.get_running_loop().create_future()
        host, port = self.reply_to.host, self.reply_to.port
        try:
            async with asyncio.timeout(self._limits.connect_s):
                reader, self._writer = await asyncio.open_connection(host, port)
            keep_alive(self._writer, self._limits)
        except OSError as e:  # TimeoutError included
            self._break(DeltaChannelError(f"cannot reach the ingress inbox {host}:{port}: {e!r}"))
            return
        try:
            async with asyncio.timeout(self._limits.handshake_s):
                if self._tls is not None:
                    await self._writer.start_tls(self._tls)
                await answer_ingress(reader, self._writer, self.reply_to.secret)
        except (OSError, DeltaChannelError) as e:
            what = f"the ingress inbox {host}:{port} failed the handshake: {e!r}"
            self._break(DeltaChannelError(what))
            return
        transport = self._writer.transport  # TLS's, if on
        transport.set_write_buffer_limits(high=self._limits.high_water)
        abort = transport.abort
        self._heartbeat = Heartbeat(self._writer.write, abort, self._limits)
        self._listen = asyncio.get_running_loop().create_task(self._listen_to(reader))

    async def _listen_to(self, reader: asyncio.StreamReader) -> None:
        """The inbox sends only pings: anything else, its end, or its silence past the
        deadline breaks the link."""
        error = DeltaChannelError("the ingress closed the delta channel")
        try:
            while (message := await read_message(reader, HANDSHAKE_FRAME_BYTES)) is not None:
                if message[0] != "ping":
                    raise DeltaChannelError(f"an unexpected {message[0][:32]!r} message")
                decode_ping(message)
                self._heartbeat.heard()
        except (ConnectionError, DeltaChannelError) as e:
            error = DeltaChannelError(f"the delta channel to the ingress broke: {e}")
        if self._heartbeat.expired:
            error = DeltaChannelError(f"the ingress was silent {self._limits.deadline_s} s")
        self._break(error)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.error is not None or self._heartbeat is None:
            self._claims, self._rows, self._held = [], [], 0
            return
        transport = self._writer.transport
        if self._draining is None and self._held:  # else held (coalesced) until drained
            frames = deltas_frames(self._rows)
            self.frames += len(frames)
            transport.write(b"".join(self._claims + frames))
            self._claims, self._rows, self._held = [], [], 0
            self._heartbeat.sent()
        buffered = transport.get_write_buffer_size() + self._held
        if buffered > self._limits.hard_cap:
            reason = f"the ingress reads too slowly ({buffered} bytes buffered)"
            self._break(DeltaChannelError(reason))
        elif self._draining is None and transport.get_write_buffer_size() > self._limits.high_water:
            self._draining = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self._writer.drain()
        except ConnectionError as e:
            self._break(DeltaChannelError(f"the delta channel broke: {e}"))
        finally:
            self._draining = None
        if self._claims or self._rows:
            self._flush()

    def _break(self, error: DeltaChannelError, abort: bool = True) -> None:
        if self.error is not None:
            return
        self.error = error
        log.warning("delta channel to %s:%d: %s", self.reply_to.host, self.reply_to.port, error)
        if self._broken is not None and not self._broken.done():
            self._broken.set_result(error)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._writer is not None:
            # An abort frees the buffers now; a close by the replica lets them go out first.
            self._writer.transport.abort() if abort else self._writer.close()
        self._claims, self._rows, self._held = [], [], 0


def _failed(delta: RequestDelta, why: str) -> RequestDelta:
    return dataclasses.replace(
        delta, new_token_ids=[], text_delta="", finished=True, finish_reason="error",
        logprobs=None, exported_chunks=None, kv_rejected=None, error=why,
    )  # fmt: skip


class DeltaOutbox:
    """One per engine replica process: its links, by ingress inbox."""

    def __init__(self, limits: ChannelLimits = LIMITS) -> None:
        self._links: dict[ReplyTo, DeltaLink] = {}
        self._limits = limits
        contexts = tls_contexts()
        self._tls = contexts[1] if contexts else None

    async def link(self, reply_to: ReplyTo) -> DeltaLink:
        """The open link to ``reply_to`` (a broken one is replaced); DeltaChannelError when
        the inbox cannot be reached or fails the handshake."""
        link = self._links.get(reply_to)
        if link is None or link.error is not None:
            # Broken links go (an ingress that restarted listens on a new port).
            self._links = {k: v for k, v in self._links.items() if v.error is None}
            link = self._links[reply_to] = DeltaLink(reply_to, self._limits, self._tls)
        await link.connected()
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


async def stream_to(link: DeltaLink, run: Awaitable[None]) -> None:
    """Runs ``run`` (an engine request whose sink sends to ``link``) until it ends; raises
    the link's error if the link breaks first, and returns only once the final delta is
    written and drained. Cancelling this cancels ``run`` (the engine aborts the request)."""
    task = asyncio.ensure_future(run)
    broken = asyncio.ensure_future(link.until_broken())
    try:
        await asyncio.wait({task, broken}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise broken.result()
        task.result()
        await link.drained()
    finally:
        broken.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
