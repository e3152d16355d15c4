"""Peers for the delta channel's tests (no Ray, loopback): raw connections before and
after the handshake, fast limits, a pickle gadget, and a check that a good replica is
still served."""

from __future__ import annotations

import asyncio
import os

from app.engine.request import RequestDelta
from app.serve.channel.delta_auth import answer_ingress
from app.serve.channel.delta_inbox import DeltaInbox
from app.serve.channel.delta_outbox import DeltaOutbox
from app.serve.channel.delta_wire import (
    ChannelLimits,
)

FAST = ChannelLimits(handshake_s=0.5, heartbeat_s=0.1, deadline_s=0.3)


class Gadget:
    """What a pickle-trusting reader would run: creates ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


async def connect(inbox: DeltaInbox):
    return await asyncio.open_connection(inbox.reply_to.host, inbox.reply_to.port)


async def authenticated(inbox: DeltaInbox):
    """A raw connection that passed the handshake (a peer holding the secret)."""
    reader, writer = await connect(inbox)
    await answer_ingress(reader, writer, inbox.reply_to.secret)
    return reader, writer


async def hung_up(reader: asyncio.StreamReader, within_s: float = 5.0) -> bool:
    """Whether the inbox closed the connection within ``within_s`` (pings are skipped)."""
    try:
        async with asyncio.timeout(within_s):
            while await reader.read(1 << 16):
                pass
    except TimeoutError:
        return False
    except ConnectionError:
        pass
    return True


async def still_serves(inbox: DeltaInbox, rid: str, outbox: DeltaOutbox | None = None) -> bool:
    """A good replica's delta still reaches a choice at ``inbox``."""
    queue = inbox.open(rid)
    link = await (outbox or DeltaOutbox()).link(inbox.reply_to)
    link.claim(rid, queue.claim)
    link.send(RequestDelta(rid, 0, [7], "ok", True, "stop"))
    got = await asyncio.wait_for(queue.get(), 5)
    inbox.close(rid)
    link.close()
    return got.new_token_ids == [7]
