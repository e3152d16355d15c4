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
from collections.abc import AsyncIterator, Callable


class Slots:
    """``total``: the replica's `max_ongoing_requests`, or a function that reads it live: Serve
    changes it in place when an operator edits only that option (no replica restart), and
    slots that kept the old count would hold Serve's calls back or let more run. A changed
    count is seen at the next take or release."""

    def __init__(self, total: int | Callable[[], int]):
        self._total = total if callable(total) else (lambda: total)
        self.in_use = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def total(self) -> int:
        return self._total()

    @property
    def free(self) -> int:
        return max(0, self.total - self.in_use)

    def try_take(self) -> bool:
        """A slot now, or False (never waits). Waiting calls are served first, so there is
        never a free slot while calls wait."""
        total = self._hand_out()
        if not self._waiters and self.in_use < total:
            self.in_use += 1
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
                with contextlib.suppress(ValueError):  # a hand-out may have dropped it
                    self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.in_use -= 1
        self._hand_out()

    def _hand_out(self) -> int:
        """Free slots pass straight to waiting calls, in arrival order; -> the count it read
        (read once: a live count is a replica-context lookup)."""
        total = self.total
        while self._waiters and self.in_use < total:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self.in_use += 1
        return total

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """One slot for the body's duration, waiting for it if none is free."""
        await self.take()
        try:
            yield
        finally:
            self.release()
