"""Abort on the offline AsyncEngine: a request that could not end on its own (ignore_eos,
thousands of max_tokens) frees every KV block within two engine steps of its cancel or
deadline.

The bound is counted in engine steps, not seconds, so it holds on a loaded machine. Seen
failing: with `Engine.abort` patched to a no-op, or with AsyncEngine.generate's `finally`
not submitting the abort, each test ran the request on to its end (~6,000 steps after the
cancel) and failed the step bound.
"""

import asyncio

import pytest

from app import LLM, SamplingParams
from app.engine.async_engine import AsyncEngine
from app.engine.request import Request
from reliability.conftest import LONG_TOKENS

PROMPT = [5, 17, 42, 99, 3, 8, 11, 23, 4, 61, 7, 19, 30, 2]  # no EOS matters: ignore_eos
MAX_STEPS_AFTER_CANCEL = 2  # the step in flight, then the one that applies the abort


@pytest.fixture(scope="module")
def llm(long_model):
    return LLM(long_model, dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20)


class StepCounter:
    """Wraps engine.step: how many steps ran (the clock of the bound)."""

    def __init__(self, engine, monkeypatch):
        self.n = 0
        step = engine.step

        def counted():
            self.n += 1
            return step()

        monkeypatch.setattr(engine, "step", counted)


async def settled(engine, counter: StepCounter, since: int) -> int:
    """Waits until the engine holds nothing; returns the steps taken since `since`."""
    while engine.has_unfinished() or engine.blocks.num_free != engine.blocks.num_blocks:
        await asyncio.sleep(0.005)
    return counter.n - since


def run_until_cut(llm, monkeypatch, params, cut):
    """Streams a long request, lets `cut(stream, tokens)` end it; -> (tokens, steps after)."""
    engine = llm.engine
    counter = StepCounter(engine, monkeypatch)

    async def main():
        agen = AsyncEngine(engine)
        stream = agen.generate(Request("long", PROMPT, params))
        tokens = await cut(stream)
        assert engine.has_unfinished()  # cut while it runs: only an abort can end it soon
        since = counter.n
        return tokens, await asyncio.wait_for(settled(engine, counter, since), 300)

    return asyncio.run(main())


LONG = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)


def test_consumer_close_aborts_within_two_steps(llm, monkeypatch):
    """Serve closes the stream (aclose) when an HTTP client disconnects or a gRPC call is
    cancelled: that must abort the engine request."""

    async def cut(stream):
        tokens = []
        async for delta in stream:
            tokens += delta.new_token_ids
            if len(tokens) >= 3:
                break
        await stream.aclose()
        return tokens

    tokens, steps = run_until_cut(llm, monkeypatch, LONG, cut)
    assert 3 <= len(tokens) < LONG_TOKENS
    assert steps <= MAX_STEPS_AFTER_CANCEL


def test_deadline_aborts_within_two_steps(llm, monkeypatch):
    """A deadline is a cancel of the consuming task (asyncio.wait_for, as gRPC/HTTP do)."""
    seen = []

    async def consume(stream):
        async for delta in stream:
            seen.extend(delta.new_token_ids)

    async def cut(stream):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(consume(stream), 0.5)
        return seen

    tokens, steps = run_until_cut(llm, monkeypatch, LONG, cut)
    assert len(tokens) < LONG_TOKENS
    assert steps <= MAX_STEPS_AFTER_CANCEL


def test_n_choices_all_aborted(llm, monkeypatch):
    """n > 1: every choice's sequence is aborted and every block is freed."""
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=LONG_TOKENS, ignore_eos=True)

    async def cut(stream):
        deltas = 0
        async for _ in stream:
            deltas += 1
            if deltas >= 6:
                break
        await stream.aclose()
        return []

    _, steps = run_until_cut(llm, monkeypatch, params, cut)
    assert steps <= MAX_STEPS_AFTER_CANCEL
