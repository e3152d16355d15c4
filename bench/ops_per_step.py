"""Top-level aten ops per engine step (how many tensor ops a step dispatches).

Runs the default model (float32, prefix caching off, one torch thread) on one prompt of 40
ids for 11 steps (1 prefill + 10 decode) under torch.profiler and counts the aten ops that
no other aten op called, by name.

    python bench/ops_per_step.py [--steps 11] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import default_model  # noqa: E402


def count_ops(steps: int) -> collections.Counter:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from app.engine.llm import LLM
    from app.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model=default_model(), dtype="float32", enable_prefix_caching=False)
    llm.generate([list(range(5, 45))], SamplingParams(max_tokens=16, ignore_eos=True))  # warm
    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate([list(range(7, 47))], params)
    counts = collections.Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            counts[e.name] += 1
    return counts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    counts = count_ops(args.steps)
    print(f"top-level aten ops per step: {sum(counts.values()) / args.steps:.1f}")
    for name, n in counts.most_common(args.top):
        print(f"{n / args.steps:7.1f} {name}")


if __name__ == "__main__":
    main()
