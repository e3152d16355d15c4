"""A cancel that lands in the same loop turn as a stream read completes must still cancel.

The gRPC ingress reads each delta through `grpc_servicer._next` (bounded by the request's
timeout). With `asyncio.wait_for` there (Python 3.11), such a cancel was swallowed: the read's
result was returned, `Generate` streamed on to the end and the engine ran the request to
completion after the client's deadline (found by the 2,000-request soak, docs/reliability.md).
No Ray: the race is forced with a future completed right before the cancel.
"""

import asyncio
import time

import pytest

from app.serve.grpc_api.grpc_servicer import _next


async def read_then_cancel() -> object:
    done = asyncio.get_running_loop().create_future()

    async def read():  # stands in for ChoiceStream.next()
        return await done

    task = asyncio.create_task(_next(read(), time.monotonic() + 60))
    await asyncio.sleep(0)  # the task now waits on the read
    done.set_result("delta")  # the read completes...
    task.cancel()  # ...and the client's cancel arrives in the same turn
    return await task


def test_cancel_as_a_read_completes_is_not_swallowed():
    """Seen failing with `asyncio.wait_for` back in `_next`: the task returned 'delta'."""
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(read_then_cancel())


def test_read_past_the_deadline_is_a_timeout():
    async def slow():
        await asyncio.sleep(5)

    with pytest.raises(TimeoutError, match="request_timeout_s"):
        asyncio.run(_next(slow(), time.monotonic() + 0.05))
