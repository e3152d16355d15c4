"""Runs one checkpoint at TP=1 (in this process) and at TP=N (spawned ranks) and compares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.llm import LLM
from app.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 8, 11], list(range(10, 47))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ATOL = 1e-4  # fp32: only the order of the partial sums differs between TP sizes


@dataclass
class Run:
    logits: list[torch.Tensor]  # per prompt: [T, vocab] next-token logits at every position
    tokens: list[list[int]]  # per prompt: greedy continuation


def make_llm(path: str, tp: int = 1, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_bytes", 1 << 20)
    return LLM(path, dtype="float32", device="cpu", tensor_parallel_size=tp, **kw)


def run(llm: LLM) -> Run:
    logits = [llm.engine.score(p) for p in PROMPTS]
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return Run(logits, tokens)


def assert_same(ref: Run, got: Run, atol: float = ATOL) -> None:
    for a, b in zip(ref.logits, got.logits):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=atol, rtol=0)
    assert got.tokens == ref.tokens


def compare(path: str, tp: int, ref_kw=None, **kw) -> None:
    """TP=tp (and **kw, e.g. enable_expert_parallel) gives TP=1's logits and tokens."""
    ref_llm = make_llm(path, **(ref_kw if ref_kw is not None else kw))
    ref = run(ref_llm)
    with make_llm(path, tp, **kw) as llm:
        assert llm.engine.tp_ctx.size == tp
        assert_same(ref, run(llm))
