"""Ingress side of the delta channel: one TCP server per ingress process, on the node IP
Ray uses; replicas connect to it, authenticate (app/serve/channel/delta_auth.py), and send one
frame per engine step (app/serve/channel/delta_wire.py); each delta goes to the queue of the choice
it belongs to (engine request ids are per choice).

A choice takes deltas only from the connection that presented its claim (the random value
the ingress put in that choice's Serve call); deltas of a choice bound to another
connection are dropped and counted (`rejected`), and a wrong claim closes the connection
that sent it. Deltas of a choice that is not open (never opened, closed or cancelled) are
dropped. When a connection ends, or is silent past the deadline, the open choices it
carried fail with a retriable `DeltaChannelError`.

Connections cost bounded memory: at most `max_handshakes` unauthenticated ones at once (a
new one pushes out the oldest, so a flood cannot lock replicas out), each with a few
hundred bytes of reads and handshake_s to finish; at most `max_connections` authenticated.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl

from app.engine.request import RequestDelta
from app.serve.channel.delta_auth import challenge_replica, new_secret, tls_contexts
from app.serve.channel.delta_codec import Claim, decode_claim, decode_deltas, decode_ping
from app.serve.channel.delta_queue import DeltaQueue
from app.serve.channel.delta_wire import (
    LIMITS,
    ChannelLimits,
    DeltaChannelError,
    Heartbeat,
    ReplyTo,
    keep_alive,
    read_message,
)

__all__ = ["DeltaInbox", "DeltaQueue"]

log = logging.getLogger(__name__)
BACKLOG = 1024  # the listen queue: a burst of connects is accepted (then capped), not dropped


class DeltaInbox:
    """Started once per ingress process (`await DeltaInbox.start(host)`)."""

    def __init__(self, host: str, limits: ChannelLimits, tls: ssl.SSLContext | None):
        self._host, self._limits, self._tls = host, limits, tls
        self._secret = new_secret()
        self._queues: dict[str, DeltaQueue] = {}
        self._server: asyncio.Server | None = None
        self._handshaking: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self._peers: set[asyncio.StreamWriter] = set()  # authenticated
        self._tasks: set[asyncio.Task] = set()  # one per connection, until it ends
        self.reply_to: ReplyTo | None = None
        self.frames = 0  # deltas frames received (tests, debugging)
        self.rejected = 0  # deltas (and claims) from a connection the choice is not bound to
        self.refused = 0  # connections closed before or in the handshake

    @classmethod
    async def start(cls, host: str = "127.0.0.1", limits: ChannelLimits = LIMITS) -> DeltaInbox:
        """Listens on ``host``: the node IP Ray uses (``ray.util.get_node_ip_address()``);
        TLS with Ray's certificates when Ray runs with TLS."""
        contexts = tls_contexts()
        inbox = cls(host, limits, contexts[0] if contexts else None)
        inbox._server = await asyncio.start_server(inbox._serve, host, 0, backlog=BACKLOG)
        port = inbox._server.sockets[0].getsockname()[1]
        inbox.reply_to = ReplyTo(host, port, inbox._secret)
        log.info("delta inbox listening on %s:%d (tls: %s)", host, port, inbox._tls is not None)
        return inbox

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def open(self, request_id: str) -> DeltaQueue:
        """Before the replica is asked to run ``request_id``: its deltas land here, from the
        connection that presents ``queue.claim``."""
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
        for writer in [*self._handshaking, *self._peers]:
            writer.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # each ends on its abort
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._connection(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()  # the loop is shutting down; asyncio owns this task
        finally:
            self._tasks.discard(task)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if not await self._admitted(reader, writer):
            self.refused += 1
            writer.transport.abort()
            return
        self._peers.add(writer)
        try:
            error = await self._receive(reader, writer)
        finally:
            self._peers.discard(writer)
            writer.transport.abort()
        for queue in self._queues.values():
            if queue.source is writer:
                queue.fail(error)

    async def _admitted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """TLS (if on) and the challenge, within handshake_s; every failure a peer can cause
        ends here, closing only its own connection."""
        if len(self._peers) >= self._limits.max_connections:
            return False
        if len(self._handshaking) >= self._limits.max_handshakes:
            oldest = next(iter(self._handshaking))
            del self._handshaking[oldest]
            oldest.transport.abort()  # its handshake fails at once
        self._handshaking[writer] = None
        try:
            keep_alive(writer, self._limits)
            async with asyncio.timeout(self._limits.handshake_s):
                if self._tls is not None:
                    await writer.start_tls(self._tls)
                await challenge_replica(reader, writer, self._secret)
        except Exception as e:  # noqa: BLE001 - garbage, a wrong MAC, a timeout, a reset
            log.debug("delta inbox: refused %s: %r", writer.get_extra_info("peername"), e)
            return False
        finally:
            self._handshaking.pop(writer, None)
        return len(self._peers) < self._limits.max_connections

    async def _receive(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> DeltaChannelError:
        """Reads an authenticated connection until it ends; returns why it ended."""
        heartbeat = Heartbeat(writer.write, writer.transport.abort, self._limits)
        try:
            while (message := await read_message(reader)) is not None:
                heartbeat.heard()
                kind = message[0]
                if kind == "deltas":
                    self.frames += 1
                    self._dispatch(decode_deltas(message), writer)
                elif kind == "claim":
                    self._bind(decode_claim(message), writer)
                elif kind == "ping":
                    decode_ping(message)
                else:
                    raise DeltaChannelError(f"an unexpected {kind[:32]!r} message")
        except Exception as e:  # noqa: BLE001 - a bad peer breaks only its own connection
            log.warning("delta inbox: closing a replica connection: %s", e)
            return DeltaChannelError(f"the delta channel from an engine replica broke: {e}")
        finally:
            heartbeat.stop()
        if heartbeat.expired:
            silent = self._limits.deadline_s
            return DeltaChannelError(f"the engine replica's delta channel was silent {silent} s")
        return DeltaChannelError("the delta channel from an engine replica closed")

    def _bind(self, claim: Claim, source: asyncio.StreamWriter) -> None:
        queue = self._queues.get(claim.request_id)
        if queue is None:
            return  # closed or cancelled before its claim came
        if not hmac.compare_digest(claim.claim, queue.claim):
            raise DeltaChannelError(f"a wrong claim for request {claim.request_id[:64]!r}")
        if queue.source is None:
            queue.source = source
        elif queue.source is not source:
            self.rejected += 1  # the choice's own connection presented it first

    def _dispatch(self, deltas: list[RequestDelta], source: asyncio.StreamWriter) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is None:
                continue  # closed or cancelled: dropped
            if queue.source is not source:
                self.rejected += 1
                continue
            queue.put(delta)
