"""The ingress's part of the prefill -> decode hand-off (disaggregated, delta channel): the
prefill's result to the decode call placed while the prefill ran (docs/serving.md "The
prefill -> decode hand-off").

A result whose KV is in-band (its chunks' bytes, no Ray ref) came back whole from the
prefill replica: a direct decode call is sent it as a `Deliver` frame on its own connection,
one TCP frame instead of the prefill replica's post to the store's hand-off box and the
box's answer to the decode replica's take (two Ray actor calls, and the box's CPU: 0.10 of
this box's 2 cores at 32 streams). A result with chunk refs was posted to the box by the
prefill replica: a direct decode call is told so (a `Deliver` of None) and takes it there.
A decode call placed through Serve cannot be delivered to and takes from the box in any
case, so an in-band result is posted there for it here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from app.kvstore.handoff import HandOffs
from app.serve.direct_calls import PlacedCall
from app.serve.messages import PrefillResult


async def hand_over(
    result: asyncio.Future[PrefillResult],
    placed: asyncio.Future[Any],
    key: str,
    box: HandOffs | None,
) -> bool:
    """Hands ``result`` (the prefill call's, awaited) to the decode call (``placed``, once
    placed) under ``key``: -> whether the result is in the box (posted by the prefill
    replica or here), where an untaken one must be discarded. Fails when the prefill fails
    or the post here does (the choice fails then, while its decode call has sent nothing)."""
    # Shielded: the choice ending (its token may end it) cancels this task, which must not
    # cancel the prefill call; its shielded publish and its placement record run on.
    prefilled = await asyncio.shield(result)
    decode = await placed
    if isinstance(decode, PlacedCall):
        try:
            await decode.assigned()  # direct, or through Serve after a refusal
        except Exception:  # noqa: BLE001 - refused or failed: the choice sees it from the call
            return prefilled.posted
        if decode.via == "direct":
            decode.deliver(None if prefilled.posted else prefilled)  # False: it has ended
            return prefilled.posted
    if not prefilled.posted and box is not None:  # a Serve call takes from the box
        await box.post(key, prefilled)
    return True


def nothing_in_the_box(handed: asyncio.Future[bool]) -> bool:
    """``handed`` (a `hand_over` task) ended knowing the result was never posted: the box
    has nothing to discard (a cancelled or failed hand-over, or one still waiting for the
    prefill's answer, may leave a posted result behind)."""
    return (
        handed.done()
        and not handed.cancelled()
        and handed.exception() is None
        and handed.result() is False
    )
