"""A choice's deltas from one engine replica call: a Serve stream (`serve_stream`), or the
ingress's delta inbox while the call, a unary `generate_to`, runs (`inbox_deltas`).
Closing either generator cancels the call, whose engine aborts the request at once. Used
by the request driver (app/serve/driver.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from app.engine.request import RequestDelta
from app.serve.delta_inbox import DeltaInbox, DeltaQueue
from app.serve.delta_wire import ReplyTo
from app.serve.direct_calls import assigned
from app.serve.responses import DONE_REASONS, AdmissionTicket

# A replica's generate_to returns after its final delta was written to the socket; the
# frame normally lands first. Past this wait after the return, the choice fails (503).
FINAL_DELTA_WAIT_S = 10.0


async def serve_stream(response) -> AsyncIterator[Any]:
    """Iterate a streaming DeploymentResponseGenerator; cancel it if we stop early."""
    done = False
    try:
        async for item in response:
            yield item
        done = True
    finally:
        if not done:
            response.cancel()


async def _result(response) -> Any:
    return await response


def _call_ended(call: asyncio.Future, queue: DeltaQueue, final: bool = True) -> None:
    """A call of the choice ended: its error fails the choice (after the deltas already
    queued); a `generate_to`'s return (``final``) means the final delta is on its way."""
    if call.cancelled():
        return
    error = call.exception()
    if error is not None:
        queue.fail(error)
    elif final:
        queue.expect_final(FINAL_DELTA_WAIT_S)


async def inbox_deltas(
    inbox: DeltaInbox,
    request_id: str,
    start: Callable[[ReplyTo], Any],
    admission: AdmissionTicket,
    first: Awaitable[RequestDelta] | None = None,
    handed: asyncio.Future | None = None,
) -> AsyncIterator[RequestDelta]:
    """One choice's deltas from the inbox while its unary `generate_to` call (``start``)
    runs. ``first``: the prefill's first delta (awaited: the decode call may be placed
    while the prefill runs), given out once the decode call has a replica (so an
    overloaded decode deployment still answers 429 before any byte); if it already ends
    the choice, the decode call is cancelled. ``handed``: the prefill's hand-over to the
    decode call, whose failure (the prefill's, even after its token) fails the choice while
    the decode call has sent nothing: that call would wait for the prefill's result in vain
    (once it sends, it has the result)."""
    queue = inbox.open(request_id)  # before the call: no delta can be missed
    try:
        response = start(inbox.reply_to)
    except BaseException:
        inbox.close(request_id)
        raise
    call = asyncio.ensure_future(_result(response))
    call.add_done_callback(lambda c: _call_ended(c, queue))
    if handed is not None:
        handed.add_done_callback(lambda h: queue.received or _call_ended(h, queue, final=False))
    try:
        if first is not None:
            await assigned(response)
            head = await first
            admission.admit()
            yield head
            if head.finish_reason in DONE_REASONS:
                return  # the prefill's token ended it: the finally cancels the decode call
        while True:
            delta = await queue.get()
            admission.admit()  # the engine took it (its refusal would come first)
            yield delta
            if delta.finished:
                break
        await call
    finally:
        inbox.close(request_id)  # its later deltas are dropped
        if not call.done() and not queue.finished:  # cancelled or failed: abort it
            response.cancel()
            call.cancel()
