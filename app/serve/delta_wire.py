"""The delta channel's wire: where a replica sends a choice's deltas, and the frames.

One TCP connection per (ingress, engine replica) pair carries the deltas of every request
the ingress sent there; one frame per engine step holds all of that step's deltas for that
ingress. A frame is a 4-byte big-endian length and a pickled ``list[RequestDelta]``.
Pickle because both ends are slimserve processes of one Ray cluster, which already trusts
its members with pickled objects (Ray's own RPCs carry pickles); the ingress also requires
its random token first on every connection, so a stray client cannot feed it frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import pickle
import struct
from dataclasses import dataclass, field

from app.engine.request import RequestDelta

TOKEN_BYTES = 16
HANDSHAKE_S = 10.0  # a peer that connects but sends no token is dropped after this
MAX_FRAME_BYTES = 256 << 20  # far above any step's deltas; a larger length is a broken peer
_LENGTH = struct.Struct("!I")


class DeltaChannelError(ConnectionError):
    """The delta channel between an ingress and an engine replica failed (retriable: the
    ingress answers 503 / UNAVAILABLE; the replica aborts the requests that used it)."""


@dataclass(frozen=True, slots=True)
class ReplyTo:
    """The ingress's inbox: where a replica sends the deltas of the requests it was given."""

    host: str
    port: int
    # TOKEN_BYTES random bytes; the first thing a connection must send (kept out of reprs)
    token: bytes = field(repr=False)


def head_id(request_id: str) -> str:
    """The inbox key of a disaggregated choice's first token, which the prefill replica
    sends ahead of its result (`PrefillServer.prefill_to`); apart from the choice's own key
    so it cannot be taken for, or reordered with, the decode replica's deltas."""
    return f"{request_id}/first"


@dataclass(frozen=True, slots=True)
class StreamSummary:
    """What a `generate_to` call returns once its final delta is on the wire."""

    request_id: str
    num_tokens: int  # output tokens sent


async def presents_token(reader: asyncio.StreamReader, token: bytes) -> bool:
    """Whether a new connection's first bytes are ``token`` (within HANDSHAKE_S); both
    socket channels require it before reading anything else."""
    with contextlib.suppress(asyncio.IncompleteReadError, asyncio.TimeoutError):
        got = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), HANDSHAKE_S)
        return hmac.compare_digest(got, token)
    return False


def encode_frame(deltas: list[RequestDelta]) -> bytes:
    payload = pickle.dumps(deltas, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> list[RequestDelta] | None:
    """The next frame's deltas; None at a clean end of stream (between frames)."""
    try:
        head = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise DeltaChannelError("the delta channel closed inside a frame header") from None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise DeltaChannelError(f"delta frame of {length} bytes is over the limit")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise DeltaChannelError("the delta channel closed inside a frame") from None
    return pickle.loads(payload)
