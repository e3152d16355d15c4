"""Tensor-parallel LLM lifecycle: shutdown(), `with`, and garbage collection each end the
worker processes and leave the process group, so a second TP LLM in the same process works.

Seen failing: without the weakref finalizer in LLM, `del llm; gc.collect()` left the worker
alive and the next `LLM(..., tensor_parallel_size=2)` raised "trying to initialize the default
process group twice!" (test_garbage_collection_...); without the check in
start_local_workers, building a second LLM while the first runs failed with that same torch
message after spawning a worker, instead of naming the live LLM.
"""

import gc
import os
import time

import pytest
import torch.distributed as dist

from app import LLM, SamplingParams

PROMPT = [5, 17, 42, 99, 3]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make(path: str) -> LLM:
    return LLM(
        path, dtype="float32", device="cpu", tensor_parallel_size=2, kv_cache_memory_bytes=1 << 20
    )


def gone(pids: list[int], wait_s: float = 30) -> bool:
    """Every pid has exited (and been reaped)."""
    end = time.monotonic() + wait_s
    while any(os.path.exists(f"/proc/{p}") for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def expected(llama_path):
    return LLM(llama_path, dtype="float32", device="cpu").generate([PROMPT], GREEDY)[0].token_ids


def test_context_manager_then_shutdown_twice(llama_path, expected):
    with make(llama_path) as llm:
        pids = llm.engine.tp_group.worker_pids
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == expected
    assert gone(pids) and not dist.is_initialized()
    llm.shutdown()  # idempotent


def test_garbage_collection_ends_workers_and_a_second_llm_works(llama_path, expected):
    llm = make(llama_path)
    pids = llm.engine.tp_group.worker_pids
    del llm
    gc.collect()
    assert gone(pids) and not dist.is_initialized()
    second = make(llama_path)
    second_pids = second.engine.tp_group.worker_pids
    try:
        assert second.generate([PROMPT], GREEDY)[0].token_ids == expected
    finally:
        second.shutdown()
    assert gone(second_pids)


def test_second_llm_while_first_runs_is_a_clear_error(llama_path):
    with make(llama_path), pytest.raises(RuntimeError, match="still running in this process"):
        make(llama_path)
    assert not dist.is_initialized()
