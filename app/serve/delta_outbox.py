"""Replica side of the delta channel: one lazily opened, reused connection per ingress
inbox (`ReplyTo`), and one frame per event-loop turn.

The AsyncEngine hands a step's deltas to their requests' sinks synchronously, in one
fan-out (`AsyncEngine.run`); `send` only appends to the destination's buffer and schedules
one flush with `call_soon`, which runs after that fan-out. So every delta of one engine
step that goes to one ingress leaves in one frame, whatever the number of streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from app.engine.request import RequestDelta
from app.serve.delta_wire import DeltaChannelError, ReplyTo, encode_frame

log = logging.getLogger(__name__)
CONNECT_S = 10.0


class DeltaLink:
    """The connection to one ingress inbox, shared by every request that replies there."""

    def __init__(self, reply_to: ReplyTo):
        self.reply_to = reply_to
        self.frames = 0  # frames written (tests, debugging)
        self.error: DeltaChannelError | None = None  # set once broken; a new link replaces it
        self._buffer: list[RequestDelta] = []
        self._flush_scheduled = False
        self._writer: asyncio.StreamWriter | None = None
        self._opening: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._broken: asyncio.Future | None = None  # result: the error, once broken

    async def connected(self) -> None:
        """Opens the connection on first use (shared by concurrent callers)."""
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)
        if self.error is not None:
            raise self.error

    def send(self, delta: RequestDelta) -> None:
        self._buffer.append(delta)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def drained(self) -> None:
        """Returns once everything sent so far is written to the socket."""
        while self._flush_scheduled:
            await asyncio.sleep(0)
        if self.error is None and self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()
        if self.error is not None:
            raise self.error

    async def until_broken(self) -> DeltaChannelError:
        assert self._broken is not None, "connected() first"
        return await asyncio.shield(self._broken)

    def close(self) -> None:
        self._break(DeltaChannelError("the delta channel was closed by the replica"))

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        self._broken = loop.create_future()
        host, port = self.reply_to.host, self.reply_to.port
        try:
            opening = asyncio.open_connection(host, port)
            reader, self._writer = await asyncio.wait_for(opening, CONNECT_S)
        except (OSError, asyncio.TimeoutError) as e:
            self._break(DeltaChannelError(f"cannot reach the ingress inbox {host}:{port}: {e}"))
            return
        self._writer.write(self.reply_to.token)
        self._watch = loop.create_task(self._watch_eof(reader))

    async def _watch_eof(self, reader: asyncio.StreamReader) -> None:
        """The inbox never writes: a read returns only when the ingress closed or died."""
        with contextlib.suppress(ConnectionError):
            await reader.read()
        self._break(DeltaChannelError("the ingress closed the delta channel"))

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._buffer or self.error is not None or self._writer is None:
            self._buffer.clear()
            return
        frame, self._buffer = encode_frame(self._buffer), []
        self._writer.write(frame)
        self.frames += 1

    def _break(self, error: DeltaChannelError) -> None:
        if self.error is not None:
            return
        self.error = error
        log.warning("delta channel to %s:%d: %s", self.reply_to.host, self.reply_to.port, error)
        if self._broken is not None and not self._broken.done():
            self._broken.set_result(error)
        if self._writer is not None:
            self._writer.close()


class DeltaOutbox:
    """One per engine replica process: its links, by ingress inbox."""

    def __init__(self) -> None:
        self._links: dict[ReplyTo, DeltaLink] = {}

    async def link(self, reply_to: ReplyTo) -> DeltaLink:
        """The open link to ``reply_to`` (a broken one is replaced); DeltaChannelError when
        the inbox cannot be reached."""
        link = self._links.get(reply_to)
        if link is None or link.error is not None:
            # Broken links go (an ingress that restarted listens on a new port).
            self._links = {k: v for k, v in self._links.items() if v.error is None}
            link = self._links[reply_to] = DeltaLink(reply_to)
        await link.connected()
        return link

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


async def stream_to(link: DeltaLink, run: Awaitable[None]) -> None:
    """Runs ``run`` (an engine request whose sink sends to ``link``) until it ends; raises
    the link's error if the link breaks first, and returns only once the final delta is on
    the wire. Cancelling this cancels ``run`` (the engine aborts the request)."""
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
