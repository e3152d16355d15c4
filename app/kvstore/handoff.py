"""Hand-offs: one value per key, posted by one replica and taken once by another, through a
small async actor beside the store shards.

The disaggregated path hands a prefill's result (its first token and the prompt's KV chunk
refs) to the decode replica that continues the request. The ingress cannot carry it: its
calls to both replicas may go over the direct call channel (app/serve/call_wire.py), which
pickles outside Ray, and a Ray `ObjectRef` pickled outside Ray is pinned for its owner's
life (Ray's documented anti-pattern). Through this actor the refs travel as Ray call
arguments and results, so Ray counts them: the box borrows them until they are taken.

Either side may come first: a take waits (bounded, ``wait_s``; the caller asks again) for
the post, and a post waits (``ttl_s``) for its take. A taker that gives up (the decode call
was cancelled) discards the key, so its value is dropped when posted, which releases its
refs; a value nobody takes or discards (its decode replica died) is dropped after ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

import ray
from ray.actor import ActorHandle

from app.kvstore.store import SHARD_GONE, STORE_NAMESPACE

log = logging.getLogger(__name__)
# A posted value not taken within this is dropped. Long: a decode call may wait in Serve's
# queue (its deployment full) while its prefill runs and posts; cancelled ones discard.
TTL_S = 600.0
WAIT_S = 5.0  # one take call waits at most this for the post (the client asks again)
TAKE_WITHIN_S = 300.0  # a client's take gives up after this in all


class HandOffBox:
    """Run as an async Ray actor (``HandOffActor``); every method runs on its event loop."""

    def __init__(self, ttl_s: float = TTL_S):
        self.ttl_s = ttl_s
        self._posted: OrderedDict[str, tuple[float, Any]] = OrderedDict()  # oldest first
        self._discarded: OrderedDict[str, float] = OrderedDict()  # discarded before posted
        self._waiting: dict[str, asyncio.Future] = {}  # key -> the take waiting for it
        counters = ("posted", "taken", "expired", "superseded", "discarded")
        self._counters = dict.fromkeys(counters, 0)

    async def post(self, key: str, value: Any) -> None:
        self._counters["posted"] += 1
        if self._discarded.pop(key, None) is not None:
            return  # its taker is gone: drop it now
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(value)
            return
        self._expire(time.monotonic())
        self._posted[key] = (time.monotonic(), value)

    async def take(self, key: str, wait_s: float = WAIT_S) -> tuple[bool, Any]:
        """(True, the value) once posted, or (False, None) after ``wait_s`` without it."""
        if key in self._posted:
            self._counters["taken"] += 1
            return True, self._posted.pop(key)[1]
        earlier = self._waiting.get(key)
        if earlier is not None and not earlier.done():  # a caller that gave up: asks again
            earlier.cancel()
            self._counters["superseded"] += 1
        waiter = self._waiting[key] = asyncio.get_running_loop().create_future()
        try:
            value = await asyncio.wait_for(asyncio.shield(waiter), wait_s)
        except TimeoutError:
            if not waiter.done() or waiter.cancelled():
                return False, None
            value = waiter.result()  # posted in the same turn as the timeout
        except asyncio.CancelledError:
            if waiter.cancelled():  # superseded by a later take of the same key
                return False, None
            raise
        finally:
            if self._waiting.get(key) is waiter:
                del self._waiting[key]
        self._counters["taken"] += 1
        return True, value

    async def discard(self, key: str) -> None:
        """The taker of ``key`` is gone: its value is dropped, now or when it is posted."""
        self._counters["discarded"] += 1
        if self._posted.pop(key, None) is None:
            self._expire(time.monotonic())
            self._discarded[key] = time.monotonic()

    async def stats(self) -> dict[str, int]:
        self._expire(time.monotonic())
        held = {"held": len(self._posted), "tombstones": len(self._discarded)}
        return {**self._counters, **held, "waiting": len(self._waiting)}

    def _expire(self, now: float) -> None:
        while self._posted:
            key, (posted_at, _) = next(iter(self._posted.items()))
            if now - posted_at < self.ttl_s:
                break
            del self._posted[key]
            self._counters["expired"] += 1
        while self._discarded and now - next(iter(self._discarded.values())) >= self.ttl_s:
            self._discarded.popitem(last=False)


HandOffActor = ray.remote(num_cpus=0, max_restarts=-1)(HandOffBox)


def box_name(store_name: str) -> str:
    return f"{store_name}-handoff"


def start_box(store_name: str, lifetime: str | None = "detached") -> ActorHandle:
    """The box of the store named ``store_name`` (started once; an existing one is reused)."""
    opts: dict = {"name": box_name(store_name), "namespace": STORE_NAMESPACE}
    opts |= {"get_if_exists": True}
    if lifetime:
        opts["lifetime"] = lifetime
    return HandOffActor.options(**opts).remote()


class HandOffs:
    """A replica's client of the box; a box found dead is started again (empty: hand-offs
    in flight are lost with it, and their decode calls fail) and the call retried once."""

    def __init__(self, store_name: str):
        self.store_name = store_name
        self.box = start_box(store_name)

    async def post(self, key: str, value: Any) -> None:
        await self._call("post", key, value)

    async def take(self, key: str, within_s: float = TAKE_WITHIN_S) -> Any:
        """The value posted under ``key``; TimeoutError if none comes within ``within_s``.
        Cancelled (the caller left), it discards the key so the value does not linger."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        try:
            while loop.time() < deadline:
                wait_s = min(WAIT_S, deadline - loop.time())
                found, value = await self._call("take", key, wait_s)
                if found:
                    return value
        except asyncio.CancelledError:
            self.box.discard.remote(key)  # fire and forget: nobody waits for it
            raise
        raise TimeoutError(f"no hand-off under {key!r} within {within_s:.0f}s")

    async def stats(self) -> dict[str, int]:
        return await self._call("stats")

    async def _call(self, method: str, *args) -> Any:
        try:
            return await getattr(self.box, method).remote(*args)
        except SHARD_GONE as e:
            log.warning("the hand-off box is gone (%s); starting a new one", e)
            self.box = start_box(self.store_name)
        return await getattr(self.box, method).remote(*args)
