"""The delta channel's wire: where a replica sends a choice's deltas, the frames, and the
limits that keep one connection's cost bounded.

One TCP connection per (ingress, engine replica) pair carries the deltas of every request
the ingress sent there; one frame per engine step holds all of that step's deltas for that
ingress. A frame is a 4-byte big-endian length and a msgpack array whose first item names
its kind; app/serve/channel/delta_codec.py holds each kind's schema and checks every field. Nothing
read from the socket is unpickled.

A connection (the replica connects to the ingress's inbox):
1. TLS first when Ray runs with TLS, with Ray's certificates (app/serve/channel/delta_auth.py).
2. A mutual HMAC challenge-response from the inbox's secret, which travels only inside Ray
   (`ReplyTo`, an argument of the Serve handle call), never on this wire.
3. Then the replica sends `claim` (a request id and the claim the ingress put in that
   request's call) before that request's `deltas`; both sides send `ping` when idle.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

MAX_FRAME_BYTES = 16 << 20  # far above any step's deltas; a larger length is a broken peer
HANDSHAKE_FRAME_BYTES = 256  # the handshake's frames and pings: a few dozen bytes each
MAX_BIN_BYTES = 64  # nonces, MACs and claims are the only binary fields
_LENGTH = struct.Struct("!I")


@dataclass(frozen=True, slots=True)
class ChannelLimits:
    """What one connection may cost; tests pass small values."""

    handshake_s: float = 2.0  # TLS and the HMAC exchange, from accept or connect
    heartbeat_s: float = 2.0  # a side that sent nothing else for this long sends a ping
    deadline_s: float = 6.0  # a side that heard nothing for this long breaks the connection
    connect_s: float = 5.0  # the replica's TCP connect
    high_water: int = 4 << 20  # write buffer past which a link holds deltas and awaits drain
    hard_cap: int = 64 << 20  # written plus held bytes past which a link breaks
    max_handshakes: int = 64  # inbox connections not yet authenticated, at once
    max_connections: int = 1024  # authenticated inbox connections


LIMITS = ChannelLimits()


class DeltaChannelError(ConnectionError):
    """The delta channel between an ingress and an engine replica failed (retriable: the
    ingress answers 503 / UNAVAILABLE; the replica aborts the requests that used it)."""


@dataclass(frozen=True, slots=True)
class ReplyTo:
    """The ingress's inbox: where a replica sends the deltas of the requests it was given.
    Passed to replicas only inside Ray (the Serve handle call's arguments)."""

    host: str
    port: int
    secret: bytes = field(repr=False)  # the HMAC key of the handshake; never on this wire


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """What a `generate_to` call returns once its final delta is on the wire."""

    request_id: str
    num_tokens: int  # output tokens sent


def pack_frame(message: list) -> bytes:
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise DeltaChannelError(f"delta frame of {len(payload)} bytes is over the limit")
    return _LENGTH.pack(len(payload)) + payload


def frame_of(payload: bytes) -> bytes:
    """A frame around an already packed message (the link packs deltas as they come)."""
    return _LENGTH.pack(len(payload)) + payload


async def read_message(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> list | None:
    """The next frame's message (a non-empty list led by its kind, not yet checked
    further); None at a clean end of stream between frames. The length is checked against
    ``limit`` before the payload is read."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise DeltaChannelError("the delta channel closed inside a frame header") from None
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise DeltaChannelError(f"delta frame of {length} bytes is over the limit of {limit}")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise DeltaChannelError("the delta channel closed inside a frame") from None
    try:
        message = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=MAX_BIN_BYTES,
            max_array_len=limit,
            max_map_len=0,  # no message has a map
            max_ext_len=0,  # nor an extension type
        )
    except Exception as e:  # noqa: BLE001 - whatever the bytes were, they are not a frame
        raise DeltaChannelError(f"undecodable delta frame ({type(e).__name__})") from None
    if type(message) is not list or not message or type(message[0]) is not str:
        raise DeltaChannelError("a delta frame that is not a message")
    return message


def keep_alive(writer: asyncio.StreamWriter, limits: ChannelLimits) -> None:
    """TCP keepalive under the heartbeat: a peer gone without a FIN is noticed by the kernel
    too (idle, interval and count where the platform has them)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = max(1, int(limits.deadline_s))
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", idle), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Heartbeat:
    """One end of an authenticated connection: pings, so that no more than heartbeat_s
    pass between the frames it sends, and ``on_dead`` once it heard nothing for
    deadline_s (checked every half heartbeat)."""

    def __init__(self, write: Callable[[bytes], None], on_dead: Callable[[], None], limits):
        self._write, self._on_dead, self._limits = write, on_dead, limits
        self._loop = asyncio.get_running_loop()
        self.sent_at = self.heard_at = self._loop.time()
        self.expired = False
        self._task = self._loop.create_task(self._beat())

    def heard(self) -> None:
        self.heard_at = self._loop.time()

    def sent(self) -> None:
        self.sent_at = self._loop.time()

    def stop(self) -> None:
        self._task.cancel()

    async def _beat(self) -> None:
        tick = min(self._limits.heartbeat_s, self._limits.deadline_s) / 2
        while True:
            await asyncio.sleep(tick)
            now = self._loop.time()
            if now - self.heard_at > self._limits.deadline_s:
                self.expired = True
                self._on_dead()
                return
            if now - self.sent_at >= self._limits.heartbeat_s - tick:
                self._write(PING_FRAME)
                self.sent_at = now


PING_FRAME = pack_frame(["ping"])
