"""Abort in the middle of speculation: shared by the n-gram, MTP and draft-model tests."""

from __future__ import annotations

from app import SamplingParams
from app.engine.engine import Engine
from app.engine.request import Request, RequestDelta


def abort_one_of_two(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, steps: int
) -> list[RequestDelta]:
    """Runs "a" (prompts[0]) and "b" (prompts[1]), aborts "a" after `steps` steps and drains.
    Asserts "a" ended as an abort and every KV block is free; returns the deltas after it."""
    engine.add_request(Request("a", prompts[0], params))
    engine.add_request(Request("b", prompts[1], params))
    for _ in range(steps):
        engine.step()
    engine.abort("a")
    deltas: list[RequestDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert any(d.request_id == "a" and d.finish_reason == "abort" for d in deltas)
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    return deltas
