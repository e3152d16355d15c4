"""One delta per sequence and step, however many tokens speculation emitted in it."""

from __future__ import annotations

from app.engine.request import RequestDelta


def merge_deltas(first: RequestDelta | None, then: RequestDelta) -> RequestDelta:
    """`then` (the later token's delta) appended to `first`; first None -> then."""
    if first is None:
        return then
    first.new_token_ids += then.new_token_ids
    first.text_delta += then.text_delta
    if then.logprobs is not None:
        first.logprobs = (first.logprobs or []) + then.logprobs
    first.finished, first.finish_reason = then.finished, then.finish_reason
    return first
