"""Hand-offs: one value per key, posted by one process (a replica or the ingress) and taken
once by another, through a small async actor beside the store shards.

The disaggregated path hands a prefill's result (its first token and the prompt's KV chunk
refs) to the decode replica that continues the request. The ingress cannot carry one with
refs: Serve's by-value transport between deployments (RAY_SERVE_THROUGHPUT_OPTIMIZED)
pickles call results outside Ray, and a Ray `ObjectRef` pickled outside Ray is pinned for
its owner's life (Ray's documented anti-pattern). Through this actor the refs travel as Ray
call arguments and results, so Ray counts them: the box borrows them until they are taken.
(A result whose KV is in-band, no ref, comes back to the ingress, which posts it here.)

Either side may come first: a take waits (bounded, ``wait_s``; the caller asks again) for
the post, and a post waits (``ttl_s``) for its take. A key may carry several values, taken
one by one in the order they were posted (an overlapped hand-off posts each part of the
prompt's KV as it is published, then the result: ``last``). A taker that gives up (the decode call
was cancelled) discards the key, and so does the ingress for a choice that ended before its
decode call completed; a discarded key's value is dropped when posted, which releases its
refs. A value nobody takes or discards (its decode replica died) is dropped after
``ttl_s`` by a sweep that runs whether or not calls come.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle

from app.kvstore.store import SHARD_GONE, STORE_NAMESPACE

log = logging.getLogger(__name__)
# A posted value not taken within this is dropped. Long: a decode call may wait in Serve's
# queue (its deployment full) while its prefill runs and posts; cancelled ones discard.
TTL_S = 600.0
# A discarded key is remembered this long, to drop a post that comes after the discard (its
# prefill was cancelled late, so it posts within its own run, seconds at most). Shorter than
# TTL_S: under an overload storm every refused or cancelled choice leaves one.
TOMBSTONE_TTL_S = 60.0
WAIT_S = 5.0  # one take call waits at most this for the post (the client asks again)
TAKE_WITHIN_S = 300.0  # a client's take gives up after this in all
# Calls the box runs at once: each waiting take holds one for up to WAIT_S (Ray's default
# for an async actor, 1,000, is reached at deploy/gpu.yaml's largest scale).
MAX_CONCURRENCY = 100_000


class HandOffLost(RuntimeError):
    """The value will not come (the box was lost with it, or none came in time): the decode
    call fails with this and the request is retriable (HTTP 503 / gRPC UNAVAILABLE)."""


@dataclass(slots=True)
class _Queued:
    """A key's values not yet taken."""

    posted_at: float  # its first value's post (the key expires ``ttl_s`` after)
    values: deque = field(default_factory=deque)
    closed: bool = False  # its last value was posted


class HandOffBox:
    """Run as an async Ray actor (``HandOffActor``); every method runs on its event loop."""

    def __init__(self, ttl_s: float = TTL_S, tombstone_ttl_s: float = TOMBSTONE_TTL_S):
        self.ttl_s, self.tombstone_ttl_s = ttl_s, tombstone_ttl_s
        self._posted: OrderedDict[str, _Queued] = OrderedDict()  # oldest first
        self._discarded: OrderedDict[str, float] = OrderedDict()  # discarded before posted
        self._waiting: dict[str, asyncio.Future] = {}  # key -> the take waiting for it
        counters = ("posted", "taken", "expired", "superseded", "discarded")
        self._counters = dict.fromkeys(counters, 0)
        self._sweeper: asyncio.Task | None = None  # started by the first call (a loop runs)

    async def post(self, key: str, value: Any, last: bool = True) -> None:
        """``last``: no more values come under ``key`` (a discard's tombstone goes then)."""
        self._sweep_now()
        self._counters["posted"] += 1
        if key in self._discarded:  # its taker is gone: drop it now
            if last:
                del self._discarded[key]
            return
        waiter = self._waiting.pop(key, None)
        if waiter is not None and not waiter.done():  # nothing queued: it would have
            waiter.set_result(value)  # been taken
            return
        queued = self._posted.setdefault(key, _Queued(time.monotonic()))
        queued.values.append(value)
        queued.closed = last

    async def take(self, key: str, wait_s: float = WAIT_S) -> tuple[bool, Any]:
        """(True, the key's next value) once posted, or (False, None) after ``wait_s``
        without it."""
        self._sweep_now()
        if key in self._posted:
            self._counters["taken"] += 1
            queued = self._posted[key]
            value = queued.values.popleft()
            if not queued.values:
                del self._posted[key]
            return True, value
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
        self._sweep_now()
        self._counters["discarded"] += 1
        queued = self._posted.pop(key, None)
        if queued is None or not queued.closed:  # more may come: drop it then
            self._discarded.pop(key, None)  # kept in time order: a repeat goes to the end
            self._discarded[key] = time.monotonic()

    async def stats(self) -> dict[str, int]:
        self._sweep_now()
        held = sum(len(q.values) for q in self._posted.values())
        held = {"held": held, "tombstones": len(self._discarded)}
        return {**self._counters, **held, "waiting": len(self._waiting)}

    def _sweep_now(self) -> None:
        """Expires what is due, and makes sure the periodic sweep runs: without calls (the
        traffic stopped) nothing else would drop what is left."""
        self._expire(time.monotonic())
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(min(self.ttl_s, self.tombstone_ttl_s) / 10)
            self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        while self._posted:
            key, queued = next(iter(self._posted.items()))
            if now - queued.posted_at < self.ttl_s:
                break
            self._counters["expired"] += len(self._posted.pop(key).values)
        while self._discarded:
            if now - next(iter(self._discarded.values())) < self.tombstone_ttl_s:
                break
            self._discarded.popitem(last=False)


HandOffActor = ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=MAX_CONCURRENCY)(HandOffBox)


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
    """A replica's (or the ingress's) client of the box. A box found dead is started again
    (empty: hand-offs in flight are lost with it); a post is retried there once, a take
    fails at once (`HandOffLost`: its value, if posted, went with the old box)."""

    def __init__(self, store_name: str):
        self.store_name = store_name
        self.box = start_box(store_name)

    async def post(self, key: str, value: Any, last: bool = True) -> None:
        try:
            await self.box.post.remote(key, value, last)
        except SHARD_GONE as e:
            self._replace(e)
            await self.box.post.remote(key, value, last)

    async def take(self, key: str, within_s: float = TAKE_WITHIN_S) -> Any:
        """The next value posted under ``key``; `HandOffLost` if none comes within ``within_s``
        or the box is lost meanwhile. Cancelled (the caller left), it discards the key so
        the value does not linger."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        try:
            while loop.time() < deadline:
                wait_s = min(WAIT_S, deadline - loop.time())
                found, value = await self.box.take.remote(key, wait_s)
                if found:
                    return value
        except asyncio.CancelledError:
            self.discard(key)
            raise
        except SHARD_GONE as e:
            self._replace(e)
            raise HandOffLost(f"the hand-off box was lost while {key!r} was awaited") from e
        raise HandOffLost(f"no hand-off under {key!r} within {within_s:.0f}s")

    def discard(self, key: str) -> None:
        """Fire and forget: nobody waits for it (a lost box lost the value anyway). Sent
        from a fresh context, as `PrefillServer._shielded` runs its publish: a discard is
        mostly made while the caller's own call is being cancelled (its client left), and
        Ray files a call under the task id it finds in a context variable and cancels that
        task's calls recursively. The disaggregated soak held 1-2 values in 3 of 5 runs
        without this (a post, no take, no discard reaching the box, the ingress's choice
        cancelled before its token), none in 4 runs with it; a unit test cancelling such a
        call directly or through Serve did not reproduce the loss, so the mechanism is
        inferred (docs/reliability.md)."""
        contextvars.Context().run(self.box.discard.remote, key)

    async def stats(self) -> dict[str, int]:
        return await self.box.stats.remote()

    def _replace(self, error: Exception) -> None:
        log.warning("the hand-off box is gone (%s); starting a new one", error)
        self.box = start_box(self.store_name)
