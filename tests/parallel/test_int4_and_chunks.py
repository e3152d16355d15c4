"""INT4 checkpoints under TP/EP, KV chunks across TP sizes, and a dead worker rank."""

import asyncio
import os
import signal
import time

import pytest
import torch

from app.engine.async_engine import AsyncEngine
from app.engine.request import Request
from app.engine.sampling_params import SamplingParams
from app.engine.tp_driver import TPWorkerError
from app.models.parallel import TPContext
from app.quant.load import load_model
from tests.parallel.helpers import compare, make_llm

PROMPT = [3 + (i * 7) % 300 for i in range(75)]  # chunks of 32, 32 and 11 tokens
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def int4_llama(checkpoint_factory, tmp_path_factory):
    from app.quant.quantize_cli import quantize_checkpoint

    out = str(tmp_path_factory.mktemp("int4_llama"))
    quantize_checkpoint(checkpoint_factory("llama"), out, "rtn", 32, symmetric=False)
    return out


@pytest.fixture(scope="module")
def int4_experts(moe_factory, tmp_path_factory):
    from tests.models.moe_checkpoints import int4_experts_checkpoint

    return int4_experts_checkpoint(
        moe_factory("deepseek_v3"), str(tmp_path_factory.mktemp("int4_ds"))
    )


def test_int4_checkpoint_tp2_fp8_kv(int4_llama):
    # Asymmetric group-32 INT4: qweight, scales and zeros shard together.
    compare(int4_llama, 2, kv_cache_dtype="fp8_e4m3")


def test_int4_experts_ep2(int4_experts):
    # Kimi K2's layout (INT4 routed experts, group 32): each expert's 32 intermediate features
    # are one group, so TP cannot split experts but EP keeps them whole.
    compare(int4_experts, 2, ref_kw={}, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="group 32"):
        load_model(int4_experts, torch.float32, "cpu", TPContext(0, 2))


def _run(engine, request):
    engine.add_request(request)
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def _tokens(deltas):
    return [t for d in deltas for t in d.new_token_ids]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 4)])
def test_chunks_cross_tp_sizes(checkpoint_factory, prefill_tp, decode_tp):
    """Chunks carry full KV heads: TP=2 exports for TP=1; TP=1 exports for TP=4 (whose KV
    heads are replicated on two ranks each)."""
    path, fp8 = checkpoint_factory("llama"), {"kv_cache_dtype": "fp8_e4m3"}  # + scales
    want = _tokens(_run(make_llm(path, **fp8).engine, Request("ref", PROMPT, GREEDY)))
    with make_llm(path, prefill_tp, **fp8) as pre, make_llm(path, decode_tp, **fp8) as dec:
        assert pre.engine.kv_spec.layout == dec.engine.kv_spec.layout
        first, done = _run(pre.engine, Request("p", PROMPT, GREEDY, prefill_only=True))
        chunks = done.exported_chunks
        follow = Request("d", PROMPT + first.new_token_ids, GREEDY, kv_import=chunks)
        rest = _run(dec.engine, follow)
        assert rest[0].num_cached_tokens == 64  # imported, not recomputed
        got = first.new_token_ids + _tokens(rest)[: GREEDY.max_tokens - 1]
    assert got == want


async def _stream(engine: AsyncEngine) -> None:
    async for _ in engine.generate(Request("after-death", PROMPT[:5], GREEDY)):
        pass


def test_dead_worker_fails_rank0_clearly(checkpoint_factory):
    llm = make_llm(checkpoint_factory("llama"), 2)
    try:
        assert llm.generate([PROMPT[:5]], GREEDY)[0].outputs[0].token_ids
        (pid,) = llm.engine.tp_group.worker_pids
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(TPWorkerError, match="rank 1 .* exited with code -9"):
            llm.generate([PROMPT[:5]], GREEDY)
        with pytest.raises(TPWorkerError, match="must be restarted"):  # stays failed
            llm.engine.score(PROMPT[:5])
        with pytest.raises(TPWorkerError):  # serving: waiters fail fast instead of hanging
            asyncio.run(asyncio.wait_for(_stream(AsyncEngine(llm.engine)), timeout=30))
    finally:
        llm.shutdown()
