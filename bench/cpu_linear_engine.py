"""In situ A/B of the C++ CPU float32 linear (slimserve_kernels/cpu_linear.py): one engine on
the default model, decode steps timed with the linears' panels in place (the kernel) and
removed (F.linear over the column-major weights), alternating per round.

Settings of bench/step_profile.py (float32, prefix caching off, ignore_eos, 64 new tokens,
prompts of 32-64 random ids, one torch thread, greedy). Per decode step (T == batch rows):
the model forward plus compute_logits, charged thread CPU time (steadier than wall time on
a shared machine); per mode the median over a round's decode steps, then the best round.

    flock /tmp/slimserve-bench.lock python bench/cpu_linear_engine.py [--batches 1,8,32]

Writes bench/results/cpu_linear_engine.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import default_model, write_json  # noqa: E402
from bench.peer import random_prompts  # noqa: E402


def decode_timer(llm, batch: int) -> list[float]:
    """Wraps the model's forward and compute_logits; returns the list that collects each
    decode step's CPU seconds (forward + logits)."""
    model, times, pending = llm.engine.runner.model, [], []
    forward, logits = model.forward, model.compute_logits

    def timed_forward(ids, *a, **kw):
        c0 = time.thread_time()
        out = forward(ids, *a, **kw)
        pending[:] = [time.thread_time() - c0 if ids.shape[0] == batch else None]
        return out

    def timed_logits(*a, **kw):
        c0 = time.thread_time()
        out = logits(*a, **kw)
        if pending and pending[0] is not None:
            times.append(pending[0] + time.thread_time() - c0)
        pending.clear()
        return out

    model.forward, model.compute_logits = timed_forward, timed_logits
    return times


def measure(batch: int, rounds: int) -> dict:
    import torch

    from app import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(
        default_model(),
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=256 << 20,
        enable_prefix_caching=False,
    )
    modules = llm.engine.runner.model.modules()
    packed = {m: m.packed for m in modules if getattr(m, "packed", None) is not None}
    assert packed, "no linear was packed (the kernel did not build?)"
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    llm.generate(random_prompts(7, batch, vocab), params)  # warm-up
    times = decode_timer(llm, batch)
    rounds_us = {"kernel": [], "aten": []}
    for r in range(rounds):
        for mode in ("aten", "kernel") if r % 2 else ("kernel", "aten"):
            for m, p in packed.items():
                m.packed = p if mode == "kernel" else None
            times.clear()
            llm.generate(random_prompts(8 + r, batch, vocab), params)
            rounds_us[mode].append(round(statistics.median(times) * 1e6))
    llm.shutdown()
    best = {mode: min(us) for mode, us in rounds_us.items()}
    return {
        "batch": batch,
        "linears_packed": len(packed),
        "model_us_per_decode_step": best,
        "rounds_us": rounds_us,
        "speedup": best["aten"] / best["kernel"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="cpu_linear_engine")
    args = ap.parse_args()
    results = []
    for b in [int(x) for x in args.batches.split(",")]:
        results.append(measure(b, args.rounds))
        print(results[-1], flush=True)
    print("wrote", write_json(args.out, {"shared_machine": True, "results": results}))


if __name__ == "__main__":
    main()
