"""Offline tok/s with the C++ CPU paged attention on and off (SLIMSERVE_CPU_KERNELS=0),
float32 and FP8 KV, at 1 / 8 / 32 prompts.

The default model, 64-token prompts of random ids, 64 new tokens, ignore_eos, greedy, prefix
caching off, 64 MiB of KV, one torch thread; per configuration a warm-up, then the best of
three runs (the kernel off and on alternate per run, each on its own engine).

    flock /tmp/slimserve-bench.lock python bench/cpu_attention.py [--batches 1,8,32]

Writes bench/results/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import default_model, write_json  # noqa: E402

KV_DTYPES = {"float32": "auto", "fp8": "fp8_e4m3"}


def prompts(seed: int, n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(64)] for _ in range(n)]


def run(llm, batch: int, seed: int) -> float:
    """Output tok/s of one generate call."""
    from app import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    start = time.perf_counter()
    outs = llm.generate(prompts(seed, batch, vocab), params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def measure(kv: str, batch: int, repeats: int) -> dict[str, float]:
    """Best tok/s with the kernel off and on."""
    from app import LLM

    llms = {}
    for mode in ("off", "on"):
        os.environ["SLIMSERVE_CPU_KERNELS"] = "0" if mode == "off" else "1"
        llms[mode] = LLM(
            default_model(),
            dtype="float32",
            kv_cache_dtype=KV_DTYPES[kv],
            enable_prefix_caching=False,
            kv_cache_memory_bytes=64 << 20,
        )
        run(llms[mode], batch, seed=0)  # warm-up
    best = dict.fromkeys(llms, 0.0)
    for r in range(repeats):
        for mode, llm in llms.items():
            os.environ["SLIMSERVE_CPU_KERNELS"] = "0" if mode == "off" else "1"
            best[mode] = max(best[mode], run(llm, batch, seed=r + 1))
    for llm in llms.values():
        llm.shutdown()
    return best


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = []
    for kv in KV_DTYPES:
        for batch in map(int, args.batches.split(",")):
            best = measure(kv, batch, args.repeats)
            rows.append({"kv": kv, "prompts": batch, "off_tok_s": best["off"],
                         "on_tok_s": best["on"], "speedup": best["on"] / best["off"]})  # fmt: skip
            r = rows[-1]
            print(f"{kv:8s} {batch:3d} prompts: off {r['off_tok_s']:7.0f}  on {r['on_tok_s']:7.0f}"
                  f"  {r['speedup']:.2f}x", flush=True)  # fmt: skip
    data = {"rows": rows, "settings": vars(args)}
    write_json("cpu_attention", data)
    return data


if __name__ == "__main__":
    main()
