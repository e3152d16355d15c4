"""Sampler benchmark: the batched sampler vs the old per-sequence `sample_batch`.

B=256 rows over a 160k vocabulary (Kimi K2's), T=0.8, top_p=0.9, on CPU. Two logit shapes:
`peaked` (a language model's usual case: the nucleus holds tens to hundreds of tokens) and
`flat` (the nucleus covers most of the vocabulary: the batched sampler's CPU shortcut cannot
apply and every row is sorted, the worst case). The old sampler is kept only as a test
reference (tests/engine/sampler_reference.py). Writes bench/results/sampler.{json,png}.

    PYTHONPATH=. python bench/sampler.py [--rows 256] [--vocab 160000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "engine")
)

from sampler_reference import sample_batch as old_sample_batch  # noqa: E402

from app.engine.sampler import SamplingBatch, sample  # noqa: E402
from app.engine.sampling_params import SamplingParams  # noqa: E402
from bench.common import bar_plot, write_json  # noqa: E402


def _logits(kind: str, rows: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=gen)
    if kind == "peaked":  # a heavy head over a Gaussian body, as an LM's next-token logits
        x *= 2.0
        head = torch.randint(0, vocab, (rows, 32), generator=gen)
        x.scatter_(-1, head, 12.0 + 3 * torch.randn(rows, 32, generator=gen))
    else:
        x *= 0.5
    return x


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(rows: int, vocab: int, repeats: int) -> dict:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1)
    seqs = [
        SimpleNamespace(params=params, token_ids=[1, 2, 3], num_sampling_prompt_tokens=3, seed=i)
        for i in range(rows)
    ]
    results = {}
    for kind in ("peaked", "flat"):
        logits = _logits(kind, rows, vocab)
        gens = [torch.Generator().manual_seed(i) for i in range(rows)]
        old = _time(lambda x=logits, g=gens: old_sample_batch(x, seqs, g), repeats)
        new = _time(lambda x=logits: sample(x, SamplingBatch.from_seqs(seqs, vocab)), repeats + 1)
        results[kind] = {"old_s": old, "new_s": new, "speedup": old / new}
        print(f"{kind}: old {old * 1e3:.0f} ms, new {new * 1e3:.0f} ms, {old / new:.1f}x")
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=160_000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    results = run(args.rows, args.vocab, args.repeats)
    config = {"rows": args.rows, "vocab": args.vocab, "temperature": 0.8, "top_p": 0.9}
    write_json("sampler", {"config": config, "results": results})
    bar_plot(
        "sampler",
        f"Sampler step, B={args.rows}, V={args.vocab}, T=0.8, top_p=0.9 (CPU, best of runs)",
        {
            "old sample_batch": {k: v["old_s"] * 1e3 for k, v in results.items()},
            "batched sample": {k: v["new_s"] * 1e3 for k, v in results.items()},
        },
        "ms per step",
    )


if __name__ == "__main__":
    main()
