"""app/serve/streaming.py (stream chunking) and the replica warm-up, without Ray."""

from __future__ import annotations

import asyncio

import pytest

from app.config import CacheConfig, EngineConfig
from app.engine.engine import Engine
from app.engine.request import Request, RequestDelta
from app.engine.sampling_params import SamplingParams
from app.serve.replicas.engine_replica import warm_up
from app.serve.streaming import coalesce, merge


def delta(i: int, last: bool = False) -> RequestDelta:
    return RequestDelta(
        "r", 0, [i], f"t{i} ", finished=last, finish_reason="length" if last else None
    )


async def collect(stream) -> list[RequestDelta]:
    return [d async for d in stream]


def test_merge_keeps_order_and_the_last_state():
    m = merge(delta(1), delta(2, last=True))
    assert m.new_token_ids == [1, 2] and m.text_delta == "t1 t2 "
    assert m.finished and m.finish_reason == "length"
    with pytest.raises(AssertionError):
        merge(delta(1), RequestDelta("other", 0, [2], ""))


def test_a_consumer_that_keeps_up_gets_every_delta_alone():
    """The source waits for the consumer before each next token: nothing is merged."""

    async def go():
        got, gate = [], asyncio.Event()

        async def source():
            for i in range(5):
                yield delta(i, last=i == 4)
                await gate.wait()
                gate.clear()

        async for d in coalesce(source()):
            got.append(d)
            gate.set()
        return got

    got = asyncio.run(go())
    assert [d.new_token_ids for d in got] == [[0], [1], [2], [3], [4]]


def test_a_lagging_consumer_gets_what_queued_up_as_one_delta():
    """Seen failing: yielding `batch[0]` instead of the merge lost tokens 2..5."""

    async def go():
        gate = asyncio.Event()

        async def source():
            yield delta(0)
            await gate.wait()
            for i in range(1, 5):
                yield delta(i, last=i == 4)

        out = []
        async for d in coalesce(source()):
            out.append(d)
            if len(out) == 1:
                gate.set()
                await asyncio.sleep(0.05)  # busy elsewhere while tokens 1..4 arrive
        return out

    got = asyncio.run(go())
    assert [d.new_token_ids for d in got] == [[0], [1, 2, 3, 4]]
    assert got[-1].finished and got[-1].text_delta == "t1 t2 t3 t4 "


def test_min_interval_holds_later_tokens_but_not_the_first():
    async def go():
        async def source():
            for i in range(4):
                yield delta(i, last=i == 3)
                await asyncio.sleep(0)

        return await collect(coalesce(source(), min_interval_s=0.5))

    got = asyncio.run(go())
    assert got[0].new_token_ids == [0]  # the first token is never held
    assert [t for d in got for t in d.new_token_ids] == [0, 1, 2, 3]
    assert len(got) == 2  # the other three shared one delta


def test_source_errors_reach_the_consumer_after_the_tokens_before_them():
    async def go():
        async def source():
            yield delta(0)
            raise ValueError("engine broke")

        got = []
        with pytest.raises(ValueError, match="engine broke"):
            async for d in coalesce(source()):
                got.append(d)
        return got

    assert [d.new_token_ids for d in asyncio.run(go())] == [[0]]


def test_closing_the_stream_closes_the_source():
    """The engine aborts a request (frees its KV) when its stream is closed. Seen failing:
    without the task.cancel() in coalesce's finally, aclose() waited on the source forever."""

    async def go():
        closed = asyncio.Event()

        async def source():
            try:
                yield delta(0)
                await asyncio.Event().wait()  # a long generation: never ends by itself
            finally:
                closed.set()

        stream = coalesce(source())
        await stream.__anext__()
        closing = asyncio.ensure_future(stream.aclose())
        done, _ = await asyncio.wait({closing}, timeout=5)  # a hang detector, not a timing
        closing.cancel()
        return bool(done) and closed.is_set()

    assert asyncio.run(go())


def test_warm_up_leaves_no_trace_a_request_could_see(tiny_model):
    """Seen failing: without the private cache salt, the same prompt afterwards had 32
    cached tokens (the warm-up's blocks); without restoring the stats, prefix_cache_queries
    counted the warm-up."""
    cache = CacheConfig(kv_cache_memory_bytes=4 << 20)
    engine = Engine(EngineConfig(model=tiny_model, dtype="float32", device="cpu", cache=cache))
    before = engine.stats()
    assert warm_up(engine, prompt_len=33) > 0
    after = engine.stats()
    assert not engine.has_unfinished()
    assert after["kv_blocks_free"] == after["kv_blocks_total"]
    for key in ("prefix_cache_queries", "prefix_cache_hits", "num_running", "num_waiting"):
        assert after[key] == before[key], key
    vocab = engine.model_config.vocab_size
    same_prompt = [(7 * i + 3) % vocab for i in range(33)]
    engine.add_request(Request("u", same_prompt, SamplingParams(max_tokens=1)))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert deltas and all(d.num_cached_tokens == 0 for d in deltas)
