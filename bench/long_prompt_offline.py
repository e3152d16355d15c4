"""The offline engine on long prompts, with the served engine's options: the baseline that
the colocated replica is held to (issue 34).

    python bench/long_prompt_offline.py [--prompt-len 1000] [--batch 32] [--threads 1]
        [--max-num-batched-tokens N] [--long-prefill-chunk N] [--repeats 3]

Prints, per repeat, the TTFT of one prompt of N tokens (its prefill steps and first token;
`max_tokens=1`) and the output tok/s of `--batch` prompts of N tokens with 64 new tokens
(greedy, ignore_eos), plus the medians. Engine options are app/serve/config.py's
SERVE_DEFAULTS unless overridden. Prompts are random token ids, fresh per repeat (no prefix
cache hits). Writes bench/results/long_prompt_offline[_<tag>].json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.common import RESULTS, write_json  # noqa: E402
from bench.peer import random_prompts  # noqa: E402

GEN = 64


def engine_options(args) -> dict:
    from app.serve.config import SERVE_DEFAULTS

    options = dict(SERVE_DEFAULTS)
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.long_prefill_chunk:
        options["long_prefill_chunk"] = args.long_prefill_chunk
    return options


def one_prompt_ttft(llm, prompt: list[int]) -> float:
    from app.engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - t0


def batch_tok_s(llm, prompts: list[list[int]]) -> tuple[float, float]:
    """(output tok/s, seconds to the last prompt's first token) for the whole batch."""
    from app.engine.request import Request
    from app.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    engine, first, out = llm.engine, None, 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"b{time.monotonic_ns()}-{i}", p, params))
    seen: set[str] = set()
    while engine.has_unfinished():
        for d in engine.step():
            out += len(d.new_token_ids)
            seen.add(d.request_id)
        if first is None and len(seen) == len(prompts):
            first = time.perf_counter() - t0
    return out / (time.perf_counter() - t0), first or 0.0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: served default")
    ap.add_argument("--long-prefill-chunk", type=int, default=0, help="0: the default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from app.assets import default_model_path
    from app.engine.llm import LLM

    options = engine_options(args)
    llm = LLM(default_model_path(), **options)
    n = args.prompt_len
    one_prompt_ttft(llm, random_prompts(0, 1, args.vocab, n, n)[0])  # warm-up
    rows = []
    for r in range(args.repeats):
        cpu0 = time.process_time()
        ttft = one_prompt_ttft(llm, random_prompts(1000 + r, 1, args.vocab, n, n)[0])
        cpu1 = time.process_time()
        tok_s, last_first = batch_tok_s(llm, random_prompts(2000 + r, args.batch, args.vocab, n, n))
        cpu_batch = time.process_time() - cpu1
        rows.append(
            {
                "ttft_1_s": ttft,
                "ttft_1_cpu_s": cpu1 - cpu0,
                "tok_s": tok_s,
                "batch_cpu_s": cpu_batch,
                "last_first_token_s": last_first,
            }
        )
        print(
            f"repeat {r}: 1 x {n} TTFT {1e3 * ttft:.1f} ms (cpu {1e3 * (cpu1 - cpu0):.0f} ms); "
            f"{args.batch} x {n}: {tok_s:.0f} tok/s (cpu {cpu_batch:.2f} s), "
            f"last first token at {last_first:.2f} s",
            flush=True,
        )
    med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print(
        f"median: TTFT {1e3 * med['ttft_1_s']:.1f} ms, {med['tok_s']:.0f} tok/s "
        f"(threads {torch.get_num_threads()}, {options})"
    )
    result = {"options": options, "threads": torch.get_num_threads(), "prompt_len": n}
    result |= {"batch": args.batch, "repeats": rows, "median": med}
    write_json("long_prompt_offline" + (f"_{args.tag}" if args.tag else ""), result, RESULTS)
    return result


if __name__ == "__main__":
    main()
