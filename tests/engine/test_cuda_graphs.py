"""Decode graphs (app/engine/cuda_graphs.py) on the CPU: bucketing, padding, static buffers
and fallbacks, with `capture_eager` standing in for a CUDA graph (same buffers and padding,
re-run instead of replayed). The replay-on-a-GPU test is tests/engine/test_cuda_graphs_gpu.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.cuda_graphs import (
    PAD_SLOT,
    bucket_sizes,
    capturable,
    capture_eager,
    pad_rows,
    pick_bucket,
)
from app.engine.request import Request
from app.engine.step import plan_step

BS = 4  # block size


@dataclass
class FakeSeq:
    """What plan_step reads of a sequence."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    spec_tokens: list[int] = field(default_factory=list)


def test_moe_models_are_captured_only_on_the_fused_path(llama_path, tmp_path):
    """The per-expert loop reads expert counts on the host once per layer, which a CUDA graph
    cannot record (capture failed on an H200): a model on it must decode eagerly. The fused
    path's layout has a static size (tests/kernels: align_rows never syncs)."""
    from models.moe_checkpoints import make_moe_checkpoint

    moe = LLM(make_moe_checkpoint("glm4_moe", str(tmp_path)), dtype="float32", device="cpu")
    assert capturable(moe.engine.model)
    for m in moe.engine.model.modules():
        if hasattr(m, "use_fused"):
            m.use_fused = False
    assert not capturable(moe.engine.model)
    assert capturable(LLM(llama_path, dtype="float32", device="cpu").engine.model)


def test_buckets():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(3) == [1, 2, 3]
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert bucket_sizes(64)[-3:] == [48, 56, 64]
    with pytest.raises(ValueError):
        bucket_sizes(0)
    assert [pick_bucket([1, 2, 4, 8], n) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]


def _decode_plan():
    """4 one-token rows over distinct blocks (none uses block 0); the third is the last
    chunk-less token of an unfinished prompt (computed, not sampled)."""
    seqs = [
        FakeSeq(list(range(3, 9)), 5, [1, 2]),  # 6 tokens: computes position 5, samples
        FakeSeq(list(range(10, 20)), 9, [3, 4, 5]),
        FakeSeq(list(range(30, 37)), 3, [6, 7]),  # 7 tokens, computes position 3 only
        FakeSeq([40, 41], 1, [8]),
    ]
    plan = plan_step([(s, 1) for s in seqs], BS)
    assert plan.is_decode and plan.sampled == [0, 1, 3]
    return plan


def test_pad_rows_repeat_the_last_row_without_a_slot():
    plan = _decode_plan()
    (ids, pos, slots, lens), tables = pad_rows(plan, 8)
    assert ids == plan.token_ids + [plan.token_ids[-1]] * 4
    assert pos == plan.positions + [plan.positions[-1]] * 4
    assert lens == plan.seq_lens + [plan.seq_lens[-1]] * 4
    assert slots == plan.slot_mapping + [PAD_SLOT] * 4
    assert tables == plan.block_tables + [plan.block_tables[-1]] * 4


@pytest.fixture
def llm(llama_path):
    return LLM(llama_path, dtype="float32", device="cpu", block_size=BS, max_num_seqs=8)


def test_replay_equals_eager_and_padding_writes_nothing(llm):
    """A 4-row decode replayed in bucket 8: the sampled rows' logits and the cache equal an
    eager forward of the same plan; padded rows and the capture write no slot.
    Seen failing: with PAD_SLOT = 0 ("capturing wrote into the cache"), and when the first
    len(sample_rows) rows were returned instead of the sampled rows (logits differ)."""
    runner, cache = llm.engine.runner, llm.engine.cache
    torch.manual_seed(0)
    cache.kv.copy_(torch.randn_like(cache.kv))  # earlier tokens' K/V, arbitrary
    before = cache.kv.clone()
    plan = _decode_plan()
    eager = runner.forward(runner.inputs(plan))
    eager_kv = cache.kv.clone()
    cache.kv.copy_(before)
    cfg = llm.engine.model_config
    runner.enable_graphs(5, cfg.max_position_embeddings, cfg.vocab_size, capture_eager)
    assert runner.graphs.buckets == [1, 2, 4, 5]
    assert torch.equal(cache.kv, before), "capturing wrote into the cache"
    ids_ptr = runner.graphs.buf.ids.data_ptr()
    out = runner.run(plan)
    assert runner.graphs.replays == {1: 0, 2: 0, 4: 1, 5: 0}
    torch.testing.assert_close(out.logits, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.kv, eager_kv, atol=1e-5, rtol=1e-5)
    changed = (cache.kv != before).flatten(4).any(-1).any(0).any(0).flatten()  # [slots]
    assert changed.nonzero().flatten().tolist() == sorted(plan.slot_mapping)
    runner.run(_decode_plan())  # a second step reads the same buffers
    assert runner.graphs.buf.ids.data_ptr() == ids_ptr
    assert runner.graphs.replays[4] == 2


def test_fallbacks_run_eager(llm):
    runner, cfg = llm.engine.runner, llm.engine.model_config
    runner.enable_graphs(2, 4 * BS, cfg.vocab_size, capture_eager)  # width: 4 blocks
    plan = _decode_plan()
    assert runner.graphs.bucket_for(plan) is None  # 4 rows > the largest bucket (2)
    prefill = plan_step([(FakeSeq([5, 6, 7], 0, [1]), 3)], BS)
    assert runner.graphs.bucket_for(prefill) is None
    wide = plan_step([(FakeSeq(list(range(3, 21)), 17, [1, 2, 3, 4, 5]), 1)], BS)
    assert runner.graphs.bucket_for(wide) is None  # 5 blocks > width 4
    short = plan_step([(FakeSeq([5, 6, 7], 2, [1]), 1)], BS)
    assert runner.graphs.bucket_for(short) == 1
    out = runner.run(plan)
    assert out.logits.shape == (3, cfg.vocab_size) and runner.graphs.fallbacks == 1
    assert sum(runner.graphs.replays.values()) == 0


def test_generate_with_graphs_equals_eager(llama_path):
    """Greedy generation with decode graphs (buckets 1, 2, 4, 8 for up to 8 sequences,
    prompts finishing at different steps so the batch shrinks 3 -> 2 -> 1) gives the tokens
    of an eager LLM, and most decode steps were replays.
    Seen failing: when positions were not copied into the static buffer (tokens differ)."""
    prompts = [[5, 17, 42, 99, 3], list(range(10, 33)), [7, 8, 9]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 20, 6)]
    kw = dict(dtype="float32", device="cpu", block_size=BS, max_num_seqs=8)
    eager = LLM(llama_path, enforce_eager=True, **kw)
    assert eager.engine.config.enforce_eager and eager.engine.runner.graphs is None
    graphed = LLM(llama_path, **kw)
    cfg = graphed.engine.model_config
    graphed.engine.runner.enable_graphs(
        8, cfg.max_position_embeddings, cfg.vocab_size, capture_eager
    )

    def run(llm):
        reqs = [Request(f"r{i}", pr, p) for i, (pr, p) in enumerate(zip(prompts, params))]
        return [o.outputs[0].token_ids for o in llm.run(reqs)]

    assert run(graphed) == run(eager)
    single = graphed.generate([prompts[0]], params[0])[0].outputs[0].token_ids
    assert single == eager.generate([prompts[0]], params[0])[0].outputs[0].token_ids
    g = graphed.engine.runner.graphs
    assert g.replays[4] >= 5 and g.replays[2] >= 5 and g.replays[1] >= 8, g.replays
    assert graphed.engine.blocks.num_free == graphed.engine.blocks.num_blocks
