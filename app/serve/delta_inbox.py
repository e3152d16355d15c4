"""Ingress side of the delta channel: one TCP server per ingress process; replicas connect
to it and send one frame per engine step (app/serve/delta_wire.py); each delta goes to the
queue of the choice it belongs to (engine request ids are per choice).

Deltas of a choice that is not open (never opened, already closed or cancelled) are
dropped. A connection that does not start with the inbox's token is closed unread. When a
connection ends, the open choices it was carrying fail with a retriable `DeltaChannelError`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from functools import reduce

from app.engine.request import RequestDelta
from app.serve.delta_wire import (
    TOKEN_BYTES,
    DeltaChannelError,
    ReplyTo,
    presents_token,
    read_frame,
)
from app.serve.streaming import merge

log = logging.getLogger(__name__)


class DeltaQueue:
    """One choice's deltas as they arrive. `get` hands over everything queued, merged into
    one delta: a consumer that lags sends fewer, fuller messages instead of falling behind."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.source: object | None = None  # the connection that delivered its deltas
        self.finished = False  # the final delta arrived
        self.received = False  # some delta arrived
        self._items: list[RequestDelta] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def put(self, delta: RequestDelta) -> None:
        if self.finished:
            return
        self._items.append(delta)
        self.finished = delta.finished
        self.received = True
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """Ends the choice with ``error`` after the deltas already queued (first error wins;
        a choice whose final delta arrived cannot fail any more)."""
        if not self.finished and self._error is None:
            self._error = error
            self._ready.set()

    def expect_final(self, within_s: float) -> None:
        """The replica's call returned, so its final delta was written before: fail if it
        has not arrived within ``within_s`` (a lost frame must not hang the choice)."""
        if not self.finished and self._timer is None:
            error = DeltaChannelError("the replica finished but its final delta never arrived")
            self._timer = asyncio.get_running_loop().call_later(within_s, self.fail, error)

    async def get(self) -> RequestDelta:
        while not self._items:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()
        items, self._items = self._items, []
        return items[0] if len(items) == 1 else reduce(merge, items)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class DeltaInbox:
    """Started once per ingress process (`await DeltaInbox.start(host)`)."""

    def __init__(self, host: str):
        self._host = host
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._queues: dict[str, DeltaQueue] = {}
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self.reply_to: ReplyTo | None = None
        self.frames = 0  # frames received (tests, debugging)

    @classmethod
    async def start(cls, host: str = "127.0.0.1") -> DeltaInbox:
        inbox = cls(host)
        inbox._server = await asyncio.start_server(inbox._serve, host, 0)
        port = inbox._server.sockets[0].getsockname()[1]
        inbox.reply_to = ReplyTo(host, port, inbox._token)
        log.info("delta inbox listening on %s:%d", host, port)
        return inbox

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def open(self, request_id: str) -> DeltaQueue:
        """Before the replica is asked to run ``request_id``: its deltas land here."""
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue = self._queues[request_id] = DeltaQueue(request_id)
        return queue

    def close(self, request_id: str) -> None:
        """The choice is over (or cancelled): its later deltas are dropped."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        error = DeltaChannelError("the delta channel from an engine replica closed")
        try:
            if not await presents_token(reader, self._token):
                log.warning("delta inbox: refused a connection without the token")
                return
            while (frame := await read_frame(reader)) is not None:
                self.frames += 1
                self._dispatch(frame, writer)
        except (DeltaChannelError, ConnectionError) as e:
            error = DeltaChannelError(f"the delta channel from an engine replica broke: {e}")
        finally:
            self._connections.discard(writer)
            for queue in self._queues.values():
                if queue.source is writer:
                    queue.fail(error)
            writer.close()

    def _dispatch(self, frame: list[RequestDelta], source: asyncio.StreamWriter) -> None:
        for delta in frame:
            queue = self._queues.get(delta.request_id)
            if queue is not None:  # else: closed or cancelled, dropped
                queue.source = source
                queue.put(delta)
