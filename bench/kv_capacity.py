"""KV capacity at one byte budget, BF16 vs FP8: tokens held, concurrent decodes before
preemption, and decode throughput at each one's max concurrency (one run).

    python bench/kv_capacity.py [--model PATH] [--budget-mib 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bar_plot, default_model, write_json  # noqa: E402


def run_batch(llm, n: int, prompt_len: int, gen: int):
    """n concurrent requests; returns (peak decoding concurrency, preemptions, decode tok/s)."""
    from app import SamplingParams
    from app.engine.request import Request

    engine = llm.engine
    before = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    for i in range(n):
        prompt = [3 + (i * 31 + j * 7) % 200 for j in range(prompt_len)]
        engine.add_request(Request(f"cap-{n}-{i}", prompt, params))
    peak, decoded, decode_time = 0, 0, 0.0
    while engine.has_unfinished():
        decoding = sum(s.is_decode for s in engine.scheduler.running)
        t = time.perf_counter()
        deltas = engine.step()
        if decoding == len(engine.scheduler.running) and decoding:
            decode_time += time.perf_counter() - t
            decoded += len(deltas)
        if engine.scheduler.num_preemptions == before:
            peak = max(peak, len(engine.scheduler.running))
    return peak, engine.scheduler.num_preemptions - before, decoded / max(decode_time, 1e-9)


def measure(model: str, kv_dtype: str, budget: int, prompt_len: int, gen: int) -> dict:
    from app import LLM

    llm = LLM(
        model,
        kv_cache_dtype=kv_dtype,
        kv_cache_memory_bytes=budget,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        long_prefill_chunk=8192,
        enable_prefix_caching=False,
    )
    blocks = llm.engine.blocks
    per_seq = blocks.blocks_for(prompt_len + gen)
    # Offer twice what could fit, so the pool (not the offer) bounds concurrency.
    peak, preempted, _ = run_batch(llm, 2 * blocks.num_blocks // per_seq + 2, prompt_len, gen)
    _, _, tps = run_batch(llm, max(peak, 1), prompt_len, gen)
    return {
        "kv_dtype": kv_dtype,
        "num_blocks": blocks.num_blocks,
        "max_tokens_held": blocks.num_blocks * blocks.block_size,
        "bytes_per_token": llm.engine.kv_spec.bytes_per_token(),
        "max_concurrent_decodes": peak,
        "preemptions_when_oversubscribed": preempted,
        "decode_tokens_per_s_at_max_concurrency": tps,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--budget-mib", type=float, default=4.0)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    args = ap.parse_args(argv)
    model = args.model or default_model()
    budget = int(args.budget_mib * (1 << 20))
    rows = {d: measure(model, d, budget, args.prompt_len, args.gen) for d in ("bf16", "fp8_e4m3")}
    b, f = rows["bf16"], rows["fp8_e4m3"]
    result = {
        "model": model,
        "budget_bytes": budget,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen,
        "results": rows,
        "capacity_ratio": f["max_tokens_held"] / b["max_tokens_held"],
        "concurrency_ratio": f["max_concurrent_decodes"] / max(b["max_concurrent_decodes"], 1),
        "throughput_ratio": f["decode_tokens_per_s_at_max_concurrency"]
        / b["decode_tokens_per_s_at_max_concurrency"],
    }
    kw = {"out_dir": args.out} if args.out else {}
    write_json("kv_capacity", result, **kw)
    bar_plot(
        "kv_capacity",
        f"KV capacity at {args.budget_mib} MiB",
        {
            d: {
                "tokens held / 100": r["max_tokens_held"] / 100,
                "concurrent decodes": r["max_concurrent_decodes"],
                "decode tok/s / 10": r["decode_tokens_per_s_at_max_concurrency"] / 10,
            }
            for d, r in rows.items()
        },
        "value",
        **kw,
    )
    for d, r in rows.items():
        print(d, r)
    print({k: result[k] for k in ("capacity_ratio", "concurrency_ratio", "throughput_ratio")})
    return result


if __name__ == "__main__":
    main()
