"""KV transfer off the step (app/engine/transfers.py): pins, aborts and failures (no Ray).

A gate (threading.Event) holds the transfer worker inside a job, so "while an export /
import is pending" is a state the test controls, not a race it hopes to win.
"""

import asyncio
import threading

import pytest

from app.config import CacheConfig, EngineConfig, SchedulerConfig
from app.engine import engine as engine_module
from app.engine import transfers
from app.engine.async_engine import AsyncEngine
from app.engine.engine import Engine
from app.engine.request import Request, RequestError
from app.engine.sampling_params import SamplingParams
from app.kv.chunk import KVChunk
from app.kv.keys import chain_hashes, make_salt

PROMPT = [3 + (i * 7) % 300 for i in range(75)]  # chunks of 32 + 32 + 11 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make_engine(path, num_blocks=None, max_num_seqs=8) -> Engine:
    budget = 2 << 20
    if num_blocks is not None:
        probe = make_engine(path)
        budget = num_blocks * probe.kv_spec.bytes_per_block()
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=budget, chunk_tokens=32)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs)
    config = EngineConfig(model=path, dtype="float32", device="cpu", cache=cache, scheduler=sched)
    return Engine(config)


def drain(engine: Engine) -> dict[str, list]:
    by_request: dict[str, list] = {}
    while engine.has_unfinished():
        for d in engine.step():
            by_request.setdefault(d.request_id, []).append(d)
    return by_request


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def gated(monkeypatch, name: str) -> threading.Event:
    """Makes the worker's `name` (write_import / encode_chunks) wait until the gate opens."""
    gate, real = threading.Event(), getattr(transfers, name)

    def wait_then_run(*args):
        assert gate.wait(60), "test gate never opened"
        return real(*args)

    monkeypatch.setattr(transfers, name, wait_then_run)
    return gate


@pytest.fixture(scope="module")
def prefill(llama_path):
    return make_engine(llama_path)


@pytest.fixture(scope="module")
def exported(prefill):
    """The prompt's first token and chunks, exported by a prefill-only request."""
    prefill.add_request(Request("p", PROMPT, GREEDY, prefill_only=True))
    first, done = drain(prefill)["p"]
    return first.new_token_ids, done.exported_chunks


@pytest.fixture(scope="module")
def reference(llama_path):
    engine = make_engine(llama_path)
    engine.add_request(Request("ref", PROMPT, GREEDY))
    engine.add_request(Request("other", PROMPT[::-1], GREEDY))
    done = drain(engine)
    return tokens(done["ref"]), tokens(done["other"])


def test_imported_blocks_stay_pinned_until_admission(llama_path, exported, reference):
    """A waits behind C and B (max_num_seqs=1) with 4 imported blocks; when B is admitted
    the pool is short and must evict a cached block. A's blocks are held, so C's go.

    Seen failing: with the hold dropped right after the write (commit_import releasing it,
    as the import did before), B evicted A's first block and A ran with 0 cached tokens."""
    first, chunks = exported
    decode = make_engine(llama_path, num_blocks=12, max_num_seqs=1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode.add_request(Request("c", [5 + i % 250 for i in range(80)], GREEDY))
    decode.step()  # C runs (5 blocks)
    decode.add_request(Request("b", [7 + i % 240 for i in range(80)], one))
    decode.add_request(Request("a", PROMPT + first, GREEDY, kv_import=chunks))
    assert decode.blocks.num_held == 4
    done = drain(decode)
    assert decode.blocks.stats.evictions >= 1  # B did have to evict a cached block
    assert done["a"][0].num_cached_tokens == 64  # every imported block was still there
    assert first + tokens(done["a"])[: GREEDY.max_tokens - 1] == reference[0]
    assert decode.blocks.num_free == decode.blocks.num_blocks and decode.blocks.num_held == 0


def test_abort_while_import_pending_frees_every_block(llama_path, exported, monkeypatch):
    """Seen failing: with poll() not releasing a cancelled job's hold, 4 blocks stayed
    pinned after the drain (num_free 4 short of the pool)."""
    first, chunks = exported
    gate = gated(monkeypatch, "write_import")
    decode = make_engine(llama_path)
    decode.add_request(Request("a", PROMPT + first, GREEDY, kv_import=chunks))
    assert decode.step() == [] and decode.blocks.num_held == 4  # A may not run yet
    decode.abort("a")
    (closing,) = decode.step()
    assert closing.finish_reason == "abort"
    # the worker is still writing into A's blocks: they must not be reused yet
    assert decode.has_unfinished() and decode.blocks.num_held == 4
    gate.set()
    drain(decode)
    assert decode.blocks.num_free == decode.blocks.num_blocks and decode.blocks.num_held == 0
    salt = make_salt(*decode.salt_base, None)
    assert not any(h.key in decode.blocks.cached for h in chain_hashes(PROMPT, 16, salt))


def test_prefill_only_token_goes_out_before_its_export(llama_path, reference, monkeypatch):
    """A prefill-only request's token leaves the step that samples it, while its KV export
    is still held on the worker; the request's final delta comes after, with the chunks
    and no token. Seen failing with the token delta kept back for the export's delta (as
    before 2026-12-05): no delta while the export was held."""
    gate = gated(monkeypatch, "encode_chunks")
    engine = make_engine(llama_path)
    engine.add_request(Request("p", PROMPT, GREEDY, prefill_only=True))
    got: list = []
    for _ in range(20):  # a step with nothing to run waits up to 20 ms for the worker
        got += engine.step()
        if got:
            break
    (first,) = got
    assert first.new_token_ids == reference[0][:1] and not first.finished
    assert engine.transfers.busy  # the export has not run yet
    gate.set()
    (done,) = drain(engine)["p"]
    assert done.finished and done.new_token_ids == [] and done.finish_reason is None
    assert sum(c.meta.num_tokens for c in done.exported_chunks) == len(PROMPT)
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_a_request_that_arrives_does_not_wait_for_anothers_export(
    llama_path, reference, monkeypatch
):
    """The engine has nothing to run but a KV export (held on the worker) and its step
    idles on it; a request that arrives then is run at once: AsyncEngine wakes the idle
    step. The idle wait is set to 60 s here, so only the wake can end it. Seen failing
    (wait_for timed out) with AsyncEngine._submit not calling engine.wake."""
    monkeypatch.setattr(engine_module, "TRANSFER_IDLE_S", 60.0)
    gate = gated(monkeypatch, "encode_chunks")
    idling, real_wait = threading.Event(), transfers.Transfers.wait

    def wait(self, timeout):
        idling.set()
        real_wait(self, timeout)

    monkeypatch.setattr(transfers.Transfers, "wait", wait)
    engine = AsyncEngine(make_engine(llama_path))

    async def collect(request):
        return [d async for d in engine.generate(request)]

    async def main():
        held = asyncio.ensure_future(collect(Request("p", PROMPT, GREEDY, prefill_only=True)))
        try:
            assert await asyncio.to_thread(idling.wait, 30), "the step never idled"
            other = await asyncio.wait_for(collect(Request("o", PROMPT[::-1], GREEDY)), 10)
        finally:
            gate.set()
        await asyncio.wait_for(held, 30)
        return other

    assert tokens(asyncio.run(main())) == reference[1]


def test_step_does_not_wait_for_export_and_abort_frees_its_blocks(
    llama_path, reference, monkeypatch
):
    """While the worker is stuck encoding P's chunks, another request decodes to the end:
    the step never waits for the export. Aborting P then frees its pinned blocks.

    Seen failing: with the export's blocks released at hand-over instead of by poll(), the
    pool was full again while the worker still read them (num_free == num_blocks)."""
    gate = gated(monkeypatch, "encode_chunks")
    engine = make_engine(llama_path)
    engine.add_request(Request("p", PROMPT, GREEDY, prefill_only=True))
    engine.add_request(Request("other", PROMPT[::-1], GREEDY))
    got: list = []
    while not engine.transfers.busy or len(tokens(got)) < GREEDY.max_tokens:
        got += [d for d in engine.step() if d.request_id == "other"]
    assert tokens(got) == reference[1] and got[-1].finished
    assert engine.blocks.num_free < engine.blocks.num_blocks  # P's blocks: pinned for export
    engine.abort("p")
    (closing,) = engine.step()
    assert closing.finish_reason == "abort" and closing.exported_chunks is None
    assert closing.new_token_ids == []  # P's token went out before, with its own delta
    gate.set()
    assert drain(engine) == {}  # the cancelled export delivers nothing
    assert engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("where", ["write_import", "encode_chunks"])
def test_worker_failure_fails_only_its_request(llama_path, exported, reference, where, monkeypatch):
    """Seen failing: with Transfers._run re-raising instead of returning the error, the
    worker thread died, the job never finished and the request hung (wait_for timed out)."""
    first, chunks = exported

    def boom(*args):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(transfers, where, boom)
    engine = AsyncEngine(make_engine(llama_path))
    bad = (
        Request("bad", PROMPT + first, GREEDY, kv_import=chunks)
        if where == "write_import"
        else Request("bad", PROMPT, GREEDY, prefill_only=True)
    )

    async def collect(request):
        return [d async for d in engine.generate(request)]

    blocks = engine.engine.blocks

    async def both():
        runs = [collect(bad), collect(Request("other", PROMPT[::-1], GREEDY))]
        out = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 120)
        # The worker hands a failed export's delta out at once (Transfers.on_export); its
        # blocks go back when the step thread next polls, which the engine's loop still
        # does (transfers.busy). Seen racing: checked before that poll, 251 of 256 free.
        for _ in range(200):
            if blocks.num_free == blocks.num_blocks:
                break
            await asyncio.sleep(0.01)
        return out

    failed, other = asyncio.run(both())
    assert isinstance(failed, RequestError) and "disk on fire" in str(failed)
    assert tokens(other) == reference[1]
    assert blocks.num_free == blocks.num_blocks and blocks.num_held == 0


def test_import_checks_the_tag_of_an_unverified_chunk(llama_path, exported, reference):
    """A decode replica hands the engine chunks whose tag is not checked yet; the import
    checks it while writing, keeps the blocks before the damaged chunk, recomputes the rest
    and reports the chunk for the store to drop.

    Seen failing: with chunk.check_tag skipped in kv_transfer._write_chunk, the damaged
    chunk was imported (64 cached tokens) and nothing was reported."""
    first, chunks = exported
    damaged = bytearray(chunks[1].encode())
    damaged[len(damaged) - chunks[1].nbytes + 5] ^= 0x40  # one KV byte of layer 0
    offered = [KVChunk.decode(bytes(c), verify_tag=False) for c in (chunks[0].encode(), damaged)]
    assert not offered[1].verified
    decode = make_engine(llama_path)
    decode.add_request(Request("d", PROMPT + first, GREEDY, kv_import=offered))
    done = drain(decode)["d"]
    assert done[0].num_cached_tokens == 32
    ((key, why),) = done[0].kv_rejected
    assert key == chunks[1].key and "tag mismatch" in why
    assert first + tokens(done)[: GREEDY.max_tokens - 1] == reference[0]
    assert decode.blocks.num_free == decode.blocks.num_blocks


@pytest.mark.parametrize("kernel", ["torch", "one_call", "one_call_tagged"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "bfloat16", "float32"])
def test_layer_writes_equal_block_writes(kv_dtype, kernel):
    """The import's write (layer by layer in torch ops, or every layer in one C++ call per
    tensor: KVCache.write_blocks; runs of consecutive blocks, gaps, one block alone) puts
    every byte where write_tokens puts it; with a tag (slimserve_kernels/cpu_tag.py: copied
    and hashed in one pass) the tag is xxh3_64 of every kv byte, then every scale byte, in
    order, the unwritten block's included.

    Seen failing: with each run taken from its last pair instead of its first, the copy of
    the (1, 6), (2, 7) run raised (the wrong token slice for the run's shape); one call, with
    the cache's plane offset computed without the layer's (every layer's blocks went to
    layer 0)."""
    import torch
    import xxhash

    from app.engine.kv_cache import KVCache
    from app.kv.layout import KVCacheSpec
    from slimserve_kernels import cpu_tag

    if kernel != "torch" and not cpu_tag.available():
        pytest.skip("the C++ CPU kernels did not build here")
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=kv_dtype)
    kv = torch.randn(2, 2, 20, 2, 4).to(spec.dtype.storage)  # 5 blocks of a chunk
    scales = (
        torch.randint(-8, 4, (2, 2, 20, 2), dtype=torch.int8) if spec.dtype.has_scales else None
    )
    pairs = [(0, 5), (1, 6), (2, 7), (4, 1)]  # chunk block 3 was cached: not written
    by_layer, by_block = KVCache(spec, 8, "cpu"), KVCache(spec, 8, "cpu")
    tag = cpu_tag.CopyingTag() if kernel == "one_call_tagged" else None
    if kernel == "torch":
        for layer in range(2):
            sc = None if scales is None else scales[layer]
            by_layer.write_layer_blocks(layer, pairs, kv[layer], sc)
    else:
        assert by_layer.copies_in_kernel(kv)
        by_layer.write_blocks(pairs, kv, scales, tag)
    if tag is not None:
        payload = kv.view(torch.uint8).numpy().tobytes()
        payload += b"" if scales is None else scales.numpy().tobytes()
        assert tag.intdigest() == xxhash.xxh3_64_intdigest(payload)
    for j, block in pairs:
        sl = slice(j * 4, (j + 1) * 4)
        by_block.write_tokens([block], kv[:, :, sl], None if scales is None else scales[:, :, sl])
    assert torch.equal(by_layer.kv.view(torch.uint8), by_block.kv.view(torch.uint8))
    if scales is not None:
        assert torch.equal(by_layer.scales, by_block.scales)


def test_request_ended_before_admission_gives_its_hold_back(llama_path, exported):
    """A waiting request that ends without running (as when its grammar fails to compile:
    Engine._end) releases its import hold.

    Seen failing: without the hold check in Engine._finish, 4 blocks stayed pinned.
    "busy" runs until aborted: with a short one, a slow import (CI under load) became ready
    in the step that "busy" finished, "a" was admitted and its hold was gone."""
    first, chunks = exported
    engine = make_engine(llama_path, max_num_seqs=1)
    endless = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    engine.add_request(Request("busy", PROMPT[::-1], endless))
    engine.step()  # "busy" runs; "a" below must wait (max_num_seqs=1)
    engine.add_request(Request("a", PROMPT + first, GREEDY, kv_import=chunks))
    while not engine.seqs["a"][0].kv_hold.ready:
        engine.step()
    engine._end(engine.seqs["a"][0], "abort")
    engine.abort("busy")
    drain(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks and engine.blocks.num_held == 0


def test_damaged_chunk_is_reported_even_when_its_blocks_are_cached(llama_path, exported):
    """The decode replica already has the prompt's blocks, so no byte of the offered chunks
    is written; a damaged one is still checked and reported, for the store to drop it.

    Seen failing: with the import committing at once when no block needs writing, nothing
    was reported (tests/reliability/serve: integrity_failures not counted for flip/swap)."""
    first, chunks = exported
    engine = make_engine(llama_path)
    engine.add_request(Request("warm", PROMPT + first, GREEDY))
    drain(engine)  # the prompt's blocks are now in the prefix cache
    damaged = bytearray(chunks[1].encode())
    damaged[len(damaged) - chunks[1].nbytes + 5] ^= 0x40
    offered = [KVChunk.decode(bytes(c), verify_tag=False) for c in (chunks[0].encode(), damaged)]
    engine.add_request(Request("d", PROMPT + first, GREEDY, kv_import=offered))
    done = drain(engine)["d"]
    ((key, why),) = done[0].kv_rejected
    assert key == chunks[1].key and "tag mismatch" in why
    assert engine.blocks.num_free == engine.blocks.num_blocks and engine.blocks.num_held == 0
