"""Stream chunking between hops: fewer, fuller deltas when the consumer lags.

Each delta that crosses a Ray Serve hop (replica -> ingress -> proxy) costs a Ray object,
an RPC and per-delta Python work on both sides, whatever the number of tokens in it
(docs/performance.md, "Served: where a token's time goes"). `coalesce` pulls the source
eagerly and hands its consumer everything that queued up since the last hand-over as one
merged delta: a consumer that keeps up still gets every step's delta at once (no added
latency, TTFT untouched); one that lags (the ingress under many streams) gets several
tokens per delta instead of falling further behind. ``min_interval_s`` > 0 also caps the
rate of deltas after the first one (tokens wait up to that long to share a delta).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from functools import reduce

from app.engine.request import RequestDelta


def merge(a: RequestDelta, b: RequestDelta) -> RequestDelta:
    """Fold two consecutive deltas of one choice into one (b is the later)."""
    assert a.request_id == b.request_id and a.index == b.index, (a.request_id, b.request_id)
    return dataclasses.replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        text_delta=a.text_delta + b.text_delta,
        logprobs=(a.logprobs or []) + (b.logprobs or []) or None,
        num_prompt_tokens=max(a.num_prompt_tokens, b.num_prompt_tokens),
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
        exported_chunks=b.exported_chunks or a.exported_chunks,
    )


async def coalesce(
    deltas: AsyncIterator[RequestDelta], min_interval_s: float = 0.0
) -> AsyncIterator[RequestDelta]:
    """The deltas of one choice, merged as described in the module docstring. Closing this
    iterator cancels the pull from ``deltas`` (the engine then aborts the request)."""
    pending: list[RequestDelta] = []
    ready = asyncio.Event()
    ended: list[BaseException | None] = []  # [None] at the end, [error] on an error

    async def pump() -> None:
        try:
            async for delta in deltas:
                pending.append(delta)
                ready.set()
            ended.append(None)
        except Exception as e:  # noqa: BLE001 - re-raised to the consumer, in order
            ended.append(e)
        finally:
            ready.set()
            aclose = getattr(deltas, "aclose", None)
            if aclose is not None:
                await aclose()

    loop = asyncio.get_running_loop()
    task = loop.create_task(pump())
    last_yield: float | None = None
    try:
        while True:
            await ready.wait()
            if min_interval_s > 0 and last_yield is not None and not ended:
                await asyncio.sleep(max(0.0, last_yield + min_interval_s - loop.time()))
            ready.clear()
            batch, pending[:] = pending[:], []
            if batch:
                last_yield = loop.time()
                yield reduce(merge, batch)
            if ended and not pending:
                if ended[0] is not None:
                    raise ended[0]
                return
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
