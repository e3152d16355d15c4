"""Tensor/expert parallelism on CPU (gloo): the overhead shape, not speed.

1. Step time at TP=1/2/4 of a small Llama (decode: 8 sequences x 1 token; prefill: 1 x 128).
2. MoE combine strategies at EP=2: all-reduce of the replicated tokens' partial outputs
   (what app/models/moe.py does) vs all-to-all dispatch + combine + all-gather.
Writes bench/results/parallel.json. Run: OMP_NUM_THREADS=1 python bench/parallel.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path[0:1] = [
    ROOT
]  # the repo root first, so `app` and `slimserve_kernels` import from the checkout
sys.path.append(os.path.join(ROOT, "tests"))
os.environ.setdefault("SLIMSERVE_TP_START_METHOD", "forkserver")
OUT = os.path.join(os.path.dirname(__file__), "results", "parallel.json")
MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
)


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def step_times(path: str, tp: int, reps: int) -> dict[str, float]:
    from app.engine.llm import LLM
    from app.engine.sampling_params import SamplingParams

    with LLM(
        path, dtype="float32", device="cpu", tensor_parallel_size=tp, kv_cache_memory_bytes=16 << 20
    ) as llm:
        prompt = [3 + i % 1000 for i in range(128)]
        prefill = _median_ms(lambda: llm.engine.score(prompt), reps)
        params = SamplingParams(temperature=0, max_tokens=reps + 1, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([[5 + i, 9, 11] for i in range(8)], params)
        total = time.perf_counter() - t0
    return {"prefill_128_ms": prefill, "decode_8seq_step_ms": 1000 * total / (reps + 1)}


def _combine_bench(rank: int, size: int, store: str, tokens: int, hidden: int, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    x = torch.randn(tokens, hidden)

    def all_reduce():  # tokens replicated: each rank's local experts' partial sum, reduced
        dist.all_reduce(x.clone())

    def all_to_all():  # each rank owns T/size tokens, sends top-2 rows to owners and back
        mine = x[rank * tokens // size : (rank + 1) * tokens // size]
        rows = mine.repeat(2, 1)  # k = 2 (token, expert) rows
        split = [len(rows) // size] * size
        counts = torch.tensor(split)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)  # exchange row counts
        recv = torch.empty(int(got.sum()), hidden)
        dist.all_to_all_single(recv, rows, got.tolist(), split)  # dispatch
        back = torch.empty_like(rows)
        dist.all_to_all_single(back, recv, split, got.tolist())  # combine
        parts = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(parts, mine)  # replicate tokens again for the next attention

    res = {"all_reduce_ms": _median_ms(all_reduce, 30), "all_to_all_ms": _median_ms(all_to_all, 30)}
    if rank == 0:
        q.put(res)
    dist.destroy_process_group()


def combine_times(tokens: int, hidden: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [
        ctx.Process(target=_combine_bench, args=(r, 2, store, tokens, hidden, q)) for r in range(2)
    ]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join()
    return res


def main() -> None:
    from tiny_models import make_checkpoint

    torch.set_num_threads(1)
    path = make_checkpoint("llama", tempfile.mkdtemp(), **MODEL)
    out = {
        "model": MODEL,
        "threads_per_rank": 1,
        "host_cores": os.cpu_count(),
        "steps": {},
        "moe_combine_ep2": {},
    }
    for tp in (1, 2, 4):
        out["steps"][f"tp{tp}"] = step_times(path, tp, reps=10)
        print(tp, out["steps"][f"tp{tp}"], flush=True)
    for tokens, hidden in ((8, 1024), (128, 1024), (512, 1024)):
        out["moe_combine_ep2"][f"T{tokens}_H{hidden}"] = combine_times(tokens, hidden)
        print(tokens, out["moe_combine_ep2"][f"T{tokens}_H{hidden}"], flush=True)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
