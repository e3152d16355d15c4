"""One choice's deltas at the ingress, as the delta channel delivers them
(app/serve/channel/delta_inbox.py)."""

from __future__ import annotations

import asyncio
import secrets
from functools import reduce

from app.engine.request import RequestDelta
from app.serve.channel.delta_codec import CLAIM_BYTES
from app.serve.channel.delta_wire import DeltaChannelError
from app.serve.streaming import merge


class DeltaQueue:
    """One choice's deltas as they arrive. `get` hands over everything queued, merged into
    one delta: a consumer that lags sends fewer, fuller messages instead of falling behind.

    ``claim`` goes to the replica inside the Serve call; the first authenticated connection
    that presents it becomes ``source``, the only one whose deltas this queue takes."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.claim = secrets.token_bytes(CLAIM_BYTES)
        self.source: object | None = None  # the connection bound by the claim
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
