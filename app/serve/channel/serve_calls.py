"""The two things the request driver needs of a Serve handle call beyond `await` and
iteration: a stream that cancels its call when the reader stops early, and the moment a
call has a replica (where an overloaded deployment refuses it, before any byte of the
answer goes out)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

# The private Serve method `assigned` awaits; tests/serve/test_serve_calls.py pins it, so
# a Ray upgrade that renames it fails there instead of silently moving admission later.
ASSIGNMENT_HOOK = "_fetch_future_result_async"


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


async def assigned(response) -> None:
    """Returns once the Serve call (`DeploymentResponse` or its generator) has a replica;
    raises BackPressureError when the deployment's queue is full. Ray offers no public
    form of this; without the hook, admission is decided by the first delta instead."""
    fetch = getattr(response, ASSIGNMENT_HOOK, None)
    if fetch is None:
        return
    try:
        await fetch()
    except asyncio.CancelledError:
        response.cancel()
        raise
