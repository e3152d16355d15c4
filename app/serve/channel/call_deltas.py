"""A choice's deltas from one engine replica call placed through Serve: a Serve stream
(`delta_channel: serve`), or, with the delta channel (`delta_channel: socket`), the unary
`generate_to` call while its deltas arrive at this ingress's inbox
(app/serve/channel/delta_inbox.py). Closing either cancels the call, whose engine aborts
the request at once. Used by the request driver (app/serve/driver.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from app.engine.request import RequestDelta
from app.serve.channel.delta_inbox import DeltaInbox, DeltaQueue
from app.serve.channel.delta_wire import ReplyTo
from app.serve.channel.serve_calls import serve_stream

# A replica's generate_to returns after its final delta was written to the socket; the
# frame normally lands first. Past this wait after the return, the choice fails (503).
FINAL_DELTA_WAIT_S = 10.0


class ChoiceCall:
    """One engine replica call running a choice: ``response`` (Serve's, for its assignment
    and cancel) and its deltas. `close()` ends it whether or not the deltas were read."""

    def __init__(self, response: Any, deltas: AsyncIterator[RequestDelta], on_close=None):
        self.response, self.deltas = response, deltas
        self._on_close = on_close
        self.finished = False  # the final delta was read

    async def __aiter__(self) -> AsyncIterator[RequestDelta]:
        async for delta in self.deltas:
            self.finished = delta.finished
            yield delta

    async def close(self) -> None:
        await self.deltas.aclose()
        if self._on_close is not None:
            self._on_close()
        if not self.finished:
            self.response.cancel()


def stream_call(response) -> ChoiceCall:
    """A Serve stream (`options(stream=True)`): its items are the deltas."""
    return ChoiceCall(response, serve_stream(response))


def inbox_call(
    inbox: DeltaInbox, request_id: str, start: Callable[[ReplyTo, bytes], Any]
) -> ChoiceCall:
    """``start(reply_to, claim)`` places the unary call whose replica sends the deltas to
    ``inbox``; the queue is opened first, so no delta can be missed, and its claim (a
    fresh random value that travels only inside Ray, in the call) binds the request id to
    the replica's connection."""
    queue = inbox.open(request_id)
    try:
        response = start(inbox.reply_to, queue.claim)
    except BaseException:
        inbox.close(request_id)
        raise
    call = asyncio.ensure_future(_result(response))
    call.add_done_callback(lambda c: _call_ended(c, queue))
    deltas = _queued(queue, call)
    return ChoiceCall(response, deltas, on_close=lambda: _closed(inbox, queue, call))


async def _queued(queue: DeltaQueue, call: asyncio.Future) -> AsyncIterator[RequestDelta]:
    while True:
        delta = await queue.get()
        yield delta
        if delta.finished:
            break
    await call  # its error (after the deltas already queued) fails the choice


def _closed(inbox: DeltaInbox, queue: DeltaQueue, call: asyncio.Future) -> None:
    inbox.close(queue.request_id)  # its later deltas are dropped
    if not call.done():
        call.cancel()


async def _result(response) -> Any:
    return await response


def _call_ended(call: asyncio.Future, queue: DeltaQueue) -> None:
    """The call ended: its error fails the choice (after the deltas already queued); its
    return means the final delta is on its way."""
    if call.cancelled():
        return
    error = call.exception()
    if error is not None:
        queue.fail(error)
    else:
        queue.expect_final(FINAL_DELTA_WAIT_S)
