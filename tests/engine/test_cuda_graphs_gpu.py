"""Decode CUDA graphs on a real GPU: replayed logits equal an eager forward of the same
plan, and greedy generation equals `enforce_eager=True`.

    TRITON_INTERPRET=0 .venv/bin/pytest tests/engine/test_cuda_graphs_gpu.py -q

Skipped without CUDA, and under the Triton interpreter (tests/conftest.py defaults it on).
"""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.step import plan_step

pytestmark = pytest.mark.gpu  # skipped without CUDA or under the interpreter (conftest)
# A set KV budget: the default (85% of free memory) leaves no room for the test's clones.
KW = dict(
    dtype="float32", device="cuda", block_size=16, max_num_seqs=16, kv_cache_memory_bytes=1 << 30
)


class Seq:
    def __init__(self, ids, computed, table):
        self.token_ids, self.num_computed_tokens, self.block_table = ids, computed, table
        self.spec_tokens = []


def test_replay_equals_eager_forward(llama_path):
    llm = LLM(llama_path, **KW)
    runner, cache = llm.engine.runner, llm.engine.cache
    assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8, 16]
    torch.manual_seed(0)
    cache.kv.copy_(torch.randn_like(cache.kv))
    seqs = [Seq(list(range(3, 3 + n)), n - 1, [1 + 4 * i + j for j in range(4)])
            for i, n in enumerate((5, 40, 17, 64, 2))]  # fmt: skip
    plan = plan_step([(s, 1) for s in seqs], 16)
    before = cache.kv.clone()
    eager = runner.forward(runner.inputs(plan))
    eager_kv = cache.kv.clone()
    cache.kv.copy_(before)
    out = runner.run(plan)  # 5 rows: bucket 8
    assert runner.graphs.replays[8] == 1
    torch.testing.assert_close(out.logits, eager, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.kv, eager_kv, atol=1e-5, rtol=1e-5)


def test_generate_equals_enforce_eager(llama_path):
    prompts = [[5, 17, 42, 99, 3], list(range(10, 47)), [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphed = LLM(llama_path, **KW)
    ours = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert sum(graphed.engine.runner.graphs.replays.values()) > 0
    eager = LLM(llama_path, enforce_eager=True, **KW)
    assert eager.engine.runner.graphs is None
    assert ours == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
