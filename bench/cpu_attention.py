"""Offline tok/s with the C++ CPU paged attention on and off (SLIMSERVE_CPU_KERNELS=0),
float32 and FP8 KV, at 1 / 8 / 32 prompts; or (--layer) the kernel alone, microseconds per
layer call.

The default model, 64-token prompts of random ids, 64 new tokens, ignore_eos, greedy, prefix
caching off, 64 MiB of KV, one torch thread; per configuration a warm-up, then the best of
three runs (the kernel off and on alternate per run, each on its own engine).

    flock /tmp/slimserve-bench.lock python bench/cpu_attention.py [--batches 1,8,32]

Writes bench/results/cpu_attention.json.

--layer: one decode layer of the embedded model's shape (Hq 4, Hkv 2, D 64, block size 16),
every sequence of the batch at the same context length, float32 and FP8 caches filled by
`reference.kv_write`, shuffled block tables; per (cache, batch, context) the best of
--repeats rounds of 50 calls, one torch thread, wall and thread CPU time (ns per key from
the CPU time). Writes bench/results/<--name>.json (default
cpu_attention_layer), with ns per key per (sequence, KV head).

    flock /tmp/slimserve-bench.lock python bench/cpu_attention.py --layer --name <label>
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


def layer_inputs(kv: str, batch: int, ctx: int, seed: int = 0) -> tuple:
    """(q, k_cache, v_cache, k_scale, v_scale, tables, lens) for one decode layer."""
    import torch

    from slimserve_kernels import reference

    hq, hkv, d, bs = 4, 2, 64, 16
    g = torch.Generator().manual_seed(seed)
    nb = batch * -(-ctx // bs)
    dtype = torch.float8_e4m3fn if kv == "fp8" else torch.float32
    kc = torch.zeros(nb, bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    scales = [torch.zeros(nb, bs, hkv, dtype=torch.int8) if kv == "fp8" else None for _ in "kv"]
    k, v = (torch.randn(nb * bs, hkv, d, generator=g) for _ in "kv")
    reference.kv_write(k, v, kc, vc, *scales, torch.arange(nb * bs))
    tables = torch.randperm(nb, generator=g).int().view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    return torch.randn(batch, hq, d, generator=g), kc, vc, *scales, tables, lens


def layer_us(args: tuple, repeats: int, calls: int = 50) -> tuple[float, float]:
    """(wall, thread CPU) best mean microseconds per paged_attention_cpu call; the CPU time
    (one torch thread: the kernel runs on the calling thread) leaves out time the shared
    machine's other processes held the core."""
    from slimserve_kernels import cpu_paged

    wall = cpu = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        start, start_cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            cpu_paged.paged_attention_cpu(*args, None, 0.125)
        cpu = min(cpu, (time.thread_time() - start_cpu) / calls * 1e6)
        wall = min(wall, (time.perf_counter() - start) / calls * 1e6)
    return wall, cpu


def layer_main(args) -> dict:
    from slimserve_kernels import cpu_paged

    rows = []
    for kv in KV_DTYPES:
        for batch in map(int, args.batches.split(",")):
            for ctx in map(int, args.contexts.split(",")):
                wall, cpu = layer_us(layer_inputs(kv, batch, ctx), args.repeats)
                ns_key = cpu * 1e3 / (batch * 2 * ctx)  # 2 KV heads
                rows.append({"kv": kv, "batch": batch, "context": ctx, "us": wall,
                             "cpu_us": cpu, "ns_per_key": ns_key})  # fmt: skip
                print(f"{kv:8s} batch {batch:3d} ctx {ctx:5d}: {wall:9.1f} us wall "
                      f"{cpu:9.1f} us CPU  {ns_key:6.2f} ns/key (CPU)", flush=True)  # fmt: skip
    data = {"rows": rows, "isa": cpu_paged.load().isa(), "settings": vars(args)}
    write_json(args.name, data)
    return data


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer", action="store_true", help="time the kernel alone, per layer")
    ap.add_argument("--contexts", default="64,128,256,512,1024", help="--layer only")
    ap.add_argument("--name", default="cpu_attention_layer", help="--layer: the JSON's name")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.layer:
        return layer_main(args)
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
