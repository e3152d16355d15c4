"""Offline generation throughput: the engine vs Hugging Face `generate` (batched, padded,
same model, prompts and output lengths, greedy) at 1, 8 and 32 concurrent prompts.

Fair to both: prefix caching off (HF has none), fresh random prompts per batch size (none
repeats across sizes), and both sides warmed up on each batch size before they are timed.
The peer that matters more, vLLM, is measured by bench/vs_vllm.py.

    python bench/throughput.py [--model PATH] [--gen 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bar_plot, default_model, write_json  # noqa: E402
from bench.peer import random_prompts  # noqa: E402


def engine_tps(llm, batch, gen: int) -> float:
    from app import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(batch, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def hf_tps(model, batch, gen: int, pad_id: int) -> float:
    import torch

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=gen,
            min_new_tokens=gen,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return (out.shape[1] - width) * len(batch) / (time.perf_counter() - t)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    from app import LLM

    model_path = args.model or default_model()
    llm = LLM(
        model_path, dtype="float32", device="cpu", enable_prefix_caching=False, show_progress=True
    )
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = llm.engine.model_config.vocab_size
    rows = {}
    sizes = [int(b) for b in args.batches.split(",")]
    for i, n in enumerate(tqdm(sizes, desc="batch sizes")):
        warm, batch = random_prompts(2 * i, n, vocab), random_prompts(2 * i + 1, n, vocab)
        engine_tps(llm, warm, 4)  # warm-up, both sides, other prompts than the timed ones
        hf_tps(hf, warm, 4, 0)
        ours, theirs = engine_tps(llm, batch, args.gen), hf_tps(hf, batch, args.gen, 0)
        rows[str(n)] = {
            "slimserve_tok_s": ours,
            "transformers_tok_s": theirs,
            "speedup": ours / theirs,
        }
        print(n, rows[str(n)])
    result = {"model": model_path, "gen_len": args.gen, "results": rows}
    kw = {"out_dir": args.out} if args.out else {}
    write_json("throughput", result, **kw)
    bar_plot(
        "throughput",
        "Offline throughput (CPU, greedy)",
        {
            "slimserve": {k: r["slimserve_tok_s"] for k, r in rows.items()},
            "transformers": {k: r["transformers_tok_s"] for k, r in rows.items()},
        },
        "tokens/s",
        **kw,
    )
    return result


if __name__ == "__main__":
    main()
