"""A replica's `max_ongoing_requests`, shared by the calls Serve places on it and the direct
calls ingresses place over its call port (app/serve/call_port.py).

Serve counts only its own calls, so without this a replica could run `max_ongoing_requests`
Serve calls beside as many direct ones. Here a Serve call waits for a slot (Serve still
counts it as ongoing, so the callers' handles queue the rest or answer 429, as before),
while a direct call takes one at once or is refused (`ReplicaBusy`: the ingress then places
it through Serve). Slots go to waiting Serve calls first, in arrival order.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator


class Slots:
    def __init__(self, total: int):
        self.total = total
        self.free = total
        self._waiters: deque[asyncio.Future] = deque()

    def try_take(self) -> bool:
        """A slot now, or False (never waits). A released slot passes straight to a waiting
        call, so there is never a free slot while calls wait."""
        if self.free > 0:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot in the same turn it was cancelled
            else:
                with contextlib.suppress(ValueError):  # a release may have dropped it
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to it
                return
        self.free += 1

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """One slot for the body's duration, waiting for it if none is free."""
        await self.take()
        try:
            yield
        finally:
            self.release()
