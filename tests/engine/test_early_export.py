"""The overlapped hand-off's engine seams (no Ray): a prefill that exports each chunk as
soon as a step computed it (`Request.export_early`), and a decode engine that imports
chunks as they come (`Request.import_only`) before the request that uses them."""

import dataclasses

import pytest

from app.config import CacheConfig, EngineConfig, SchedulerConfig
from app.engine.engine import Engine
from app.engine.request import Request
from app.kv.chunk import KVChunk
from tests.engine.test_kv_transfer import GREEDY, PROMPT, run

STEP = 32  # long_prefill_chunk: PROMPT (75 tokens) is computed in 3 steps of <= 32


def make_engine(path, step: int = STEP) -> Engine:
    cache = CacheConfig(
        block_size=16, kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=2 << 20, chunk_tokens=32
    )
    sched = SchedulerConfig(long_prefill_chunk=step)
    return Engine(
        EngineConfig(model=path, dtype="float32", device="cpu", cache=cache, scheduler=sched)
    )


def wire(chunks) -> list[KVChunk]:
    """As chunks cross processes: decoded without the tag check (the import checks it)."""
    return [KVChunk.decode(c.encode(), verify_tag=False) for c in chunks]


def prefill_early(engine: Engine, rid: str = "p"):
    """-> (early parts: [[chunk]], the token's delta, the final delta). A part may come
    after the token (its export runs on the transfer thread), never after the final delta
    (one thread, in order)."""
    deltas = run(engine, Request(rid, PROMPT, GREEDY, prefill_only=True, export_early=True))
    (first,) = [d for d in deltas if d.new_token_ids]
    *early, done = [d for d in deltas if not d.new_token_ids]
    assert all(not d.finished for d in early) and done.finished and not first.finished
    return [d.exported_chunks for d in early], first, done


def verified(chunks: list[KVChunk]) -> list[KVChunk]:
    return [dataclasses.replace(c, verified=True) for c in chunks]


@pytest.fixture(scope="module")
def reference(llama_path) -> list[int]:
    deltas = run(make_engine(llama_path), Request("ref", PROMPT, GREEDY))
    return [t for d in deltas for t in d.new_token_ids]


def test_chunks_go_out_as_computed_and_equal_the_whole_export(llama_path):
    """Seen failing: with `_export_early` not called, no part came before the token."""
    engine = make_engine(llama_path)
    parts, first, done = prefill_early(engine)
    assert [[c.meta.start_pos for c in p] for p in parts] == [[0], [32]]  # one per step
    assert [c.meta.start_pos for c in done.exported_chunks] == [64]  # the partial rest
    _, whole = run(engine, Request("w", PROMPT, GREEDY, prefill_only=True))
    early = [c for p in parts for c in p] + done.exported_chunks
    assert [c.encode() for c in early] == [c.encode() for c in whole.exported_chunks]
    assert early[1].meta.parent_key == early[0].key
    assert engine.blocks.num_free == engine.blocks.num_blocks  # the pins went back


def test_chunks_imported_as_they_come_continue_like_one_engine(llama_path, reference):
    """Each part imported alone (import_only), then the request with all of them: the
    prefix match finds the parts already written; the output is the one engine's."""
    parts, first, done = prefill_early(make_engine(llama_path))
    decode = make_engine(llama_path)
    sent: list[KVChunk] = []
    for i, part in enumerate(parts):
        sent += wire(part)
        end = sent[-1].meta.start_pos + sent[-1].meta.num_tokens
        (ended,) = run(
            decode, Request(f"i{i}", PROMPT[:end], kv_import=list(sent), import_only=True)
        )
        assert ended.finished and not ended.new_token_ids and not ended.kv_rejected
        sent = verified(sent)  # as the decode replica marks what its import checked
    assert decode.blocks.num_free == decode.blocks.num_blocks  # cached, not pinned
    assert len(decode.blocks.cached) == 4  # the parts' whole blocks, findable
    sent += wire(done.exported_chunks)
    rest = run(decode, Request("d", PROMPT + first.new_token_ids, GREEDY, kv_import=sent))
    got = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
    assert got[: len(reference)] == reference
    assert rest[0].num_cached_tokens == 64
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_a_corrupted_middle_chunk_is_rejected_and_recomputed(llama_path, reference):
    """Seen failing: with write_import's tag check skipped, the damaged chunk was imported
    (num_cached_tokens 64) and the output changed."""
    parts, first, done = prefill_early(make_engine(llama_path))
    decode = make_engine(llama_path)
    good, bad = wire(parts[0]), wire(parts[1])
    damaged = bytearray(parts[1][0].encode())
    damaged[-1] ^= 0xFF  # the last payload byte: the header still parses
    (bad,) = wire([KVChunk.decode(bytes(damaged), verify_tag=False)])
    (ended,) = run(decode, Request("i", PROMPT[:64], kv_import=good + [bad], import_only=True))
    assert [key for key, _ in ended.kv_rejected] == [bad.key]
    sent = verified(good) + [bad] + wire(done.exported_chunks)
    rest = run(decode, Request("d", PROMPT + first.new_token_ids, GREEDY, kv_import=sent))
    assert rest[0].kv_rejected and rest[0].num_cached_tokens == 32  # recomputed from 32
    got = first.new_token_ids + [t for d in rest for t in d.new_token_ids]
    assert got[: len(reference)] == reference
    assert decode.blocks.num_free == decode.blocks.num_blocks


def test_abort_mid_prefill_frees_the_blocks_early_exports_pinned(llama_path):
    engine = make_engine(llama_path)
    engine.add_request(Request("p", PROMPT, GREEDY, prefill_only=True, export_early=True))
    seen = engine.step()  # the first 32 tokens: their chunk's export is under way
    assert engine.transfers.busy and not seen
    engine.abort("p")
    while engine.has_unfinished():
        seen += engine.step()
    assert seen[-1].finish_reason == "abort" and sum(d.finished for d in seen) == 1
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_abort_of_an_import_in_flight_frees_its_blocks(llama_path):
    parts, _, _ = prefill_early(make_engine(llama_path))
    decode = make_engine(llama_path)
    decode.add_request(Request("i", PROMPT[:32], kv_import=wire(parts[0]), import_only=True))
    decode.abort("i")
    deltas = []
    while decode.has_unfinished():
        deltas += decode.step()
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert decode.blocks.num_free == decode.blocks.num_blocks and not decode.blocks.num_held


def test_an_import_of_nothing_usable_ends_at_once(llama_path):
    parts, _, _ = prefill_early(make_engine(llama_path))
    decode = make_engine(llama_path)
    other = [PROMPT[0] + 1] + PROMPT[1:32]  # the chunk does not continue this prompt
    (ended,) = run(decode, Request("i", other, kv_import=wire(parts[0]), import_only=True))
    assert ended.finished and not decode.blocks.cached


def slowed(engine: Engine, step_s: float = 0.2, after_s: float = 0.0) -> list[float]:
    """Makes every step of ``engine`` take ``step_s`` more, and ``after_s`` between its
    end and its fan-out; -> the steps' end times."""
    import time

    ended: list[float] = []
    step, run = engine.step, engine.runner.run

    def slow_run(plan):
        time.sleep(step_s)
        return run(plan)

    def timed_step():
        out = step()
        ended.append(time.perf_counter())
        time.sleep(after_s)
        return out

    engine.step, engine.runner.run = timed_step, slow_run
    return ended


def test_an_early_part_reaches_its_reader_while_the_next_step_runs(llama_path):
    """Through the AsyncEngine, an early export's delta goes out from the transfer worker at
    once (`Transfers.on_export`), not at the next step's poll: with steps of 0.2 s, the
    first part (computed by step 1) arrives before step 2 ends. Seen failing (it arrived
    after step 2) without the AsyncEngine's hook."""
    import asyncio
    import time

    from app.engine.async_engine import AsyncEngine

    engine = make_engine(llama_path)
    ended = slowed(engine)

    async def main() -> list[float]:
        # Read to the end: leaving at the first part would abort the request, and under
        # load that can come before step 2 starts (then there is no step 2 to compare).
        request = Request("p", PROMPT, GREEDY, prefill_only=True, export_early=True)
        return [
            time.perf_counter()
            async for delta in AsyncEngine(engine).generate(request)
            if delta.exported_chunks and not delta.finished
        ]

    arrivals = asyncio.run(main())
    assert arrivals, "no early part"
    assert len(ended) >= 2 and arrivals[0] < ended[1] - 0.05, (arrivals, ended)  # step 2's end


def test_a_final_export_goes_out_after_its_token_without_waiting_for_a_step(llama_path):
    """Another request keeps the engine stepping (0.2 s a step): a short prefill-only
    request's final delta (its chunks) goes out as soon as the transfer worker has it,
    after its token, not at the end of the step that runs meanwhile. Seen failing (0.2 s
    after the token) with the AsyncEngine's hook removed, and (the chunks before the
    token: the stream ended without it) with the final delta not held for its token."""
    import asyncio
    import time

    from app.engine.async_engine import AsyncEngine
    from app.engine.sampling_params import SamplingParams

    engine = make_engine(llama_path)
    slowed(engine, after_s=0.05)  # the export is done before its token's fan-out
    busy = Request(
        "busy", PROMPT[:8], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )

    async def main() -> list:
        async_engine = AsyncEngine(engine)
        background = asyncio.ensure_future(_drain(async_engine.generate(busy)))
        await asyncio.sleep(0.3)  # "busy" is decoding
        got = []
        async for delta in async_engine.generate(
            Request("p", PROMPT[:40], GREEDY, prefill_only=True)
        ):
            got.append((delta, time.perf_counter()))
        background.cancel()
        await asyncio.gather(background, return_exceptions=True)
        return got

    (token, t_token), (final, t_final) = asyncio.run(main())
    assert token.new_token_ids and not token.finished  # the token first, then the chunks
    assert final.finished and final.exported_chunks
    assert t_final - t_token < 0.1, t_final - t_token


async def _drain(deltas) -> None:
    async for _ in deltas:
        pass
