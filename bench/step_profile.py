"""Where one offline engine step's time goes: model / attention / sampler / scheduler / other.

Runs `LLM.generate` on the default model (the settings of bench/vs_vllm.py: float32, prefix
caching off, ignore_eos, 64 new tokens, prompts of 32-64 random ids, one torch thread) with
the engine's parts wrapped by timers. Each part is charged its own thread CPU time
(`time.thread_time`: the one torch thread runs on this thread, and CPU time is far steadier
than wall time on a shared machine) and wall time; nested parts (attention inside the model)
are subtracted from their parent. "other" is the step's time outside every wrapped part
(the engine's own glue, grammar polls, logits bookkeeping).

    python bench/step_profile.py [--batches 1,8,32] [--eager] [--label before] [--threads 2]

Decode steps over long contexts (the steps a long prompt's stream waits on between tokens):
--prompt-len N (prompts of N random ids), --kv-cache-dtype fp8_e4m3 (the served default)
and --decode-only: every prompt is prefilled in one step (the step budget raised to hold
them all), then only the steps in which every sequence decodes are timed and counted, so
each of them runs the whole batch (`decode_batch_mean` says so); e.g. `--batches 1,8,32
--prompt-len 1000 --gen 24 --kv-cache-dtype fp8_e4m3 --decode-only --label
decode_1000_fp8`. `tok_s` always includes the prefill.

With --threads N > 1 the CPU columns count only this thread (the other torch threads' work
inside an op is not charged); read the wall columns (`wall_us_per_step`) then.

Writes bench/results/step_profile.json (one entry per label, so a "before" and an "after"
run sit side by side).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, default_model  # noqa: E402
from bench.peer import random_prompts  # noqa: E402

PARTS = ("scheduler", "inputs", "model", "attention", "logits", "sampler", "outputs")


class Timers:
    """Exclusive CPU and wall seconds per part (a nested part is not charged to its parent)."""

    def __init__(self):
        self.cpu = dict.fromkeys(PARTS + ("step",), 0.0)
        self.wall = dict.fromkeys(PARTS + ("step",), 0.0)
        self.stack: list[str] = []
        self.on = True  # off: nothing is charged (--decode-only, a step with a prefill)

    @contextmanager
    def part(self, name: str):
        if not self.on:
            yield
            return
        c0, w0 = time.thread_time(), time.perf_counter()
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()
            dc, dw = time.thread_time() - c0, time.perf_counter() - w0
            self.cpu[name] += dc
            self.wall[name] += dw
            if self.stack:  # the parent was charged too: take it back
                self.cpu[self.stack[-1]] -= dc
                self.wall[self.stack[-1]] -= dw

    def wrap(self, obj, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            with self.part(name):
                return fn(*a, **kw)

        setattr(obj, attr, timed)


def instrument(llm) -> Timers:
    import app.engine.attention as attention
    import app.engine.engine as engine_mod

    t, eng = Timers(), llm.engine
    t.wrap(eng, "step", "step")
    t.wrap(eng.scheduler, "schedule", "scheduler")
    t.wrap(engine_mod, "plan_step", "inputs")
    runner = eng.runner
    t.wrap(runner, "inputs", "inputs")
    t.wrap(runner.model, "forward", "model")
    t.wrap(runner.model, "compute_logits", "logits")
    call = attention.PagedAttention.__call__

    def timed_attention(self, *a):
        with t.part("attention"):
            return call(self, *a)

    attention.PagedAttention.__call__ = timed_attention
    t.wrap(eng, "_sample", "sampler")
    t.wrap(eng, "_apply", "outputs")
    return t


def all_decoding(engine) -> bool:
    """The next step decodes only: nothing waits, every running sequence has its prompt."""
    running = engine.scheduler.running
    return bool(running) and not engine.scheduler.waiting and all(s.is_decode for s in running)


def profile(model: str, batch: int, temperature: float, args) -> dict:
    from app import LLM, SamplingParams

    kw = {"enforce_eager": True} if args.eager else {}
    if args.decode_only:  # one prefill step for the whole batch: the decodes run together
        longest = args.prompt_len or 64
        kw |= {"max_num_batched_tokens": max(2048, batch * longest), "long_prefill_chunk": longest}
    llm = LLM(
        model,
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=256 << 20,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=False,
        **kw,
    )
    top_p = 0.9 if temperature else 1.0
    params = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=args.gen, ignore_eos=True
    )
    vocab = llm.engine.model_config.vocab_size
    lengths = (args.prompt_len, args.prompt_len) if args.prompt_len else (32, 64)
    llm.generate(random_prompts(7, batch, vocab, *lengths), params)  # warm-up (and any compile)
    timers = instrument(llm)
    steps = batch_rows = 0
    step = llm.engine.step

    def counted():
        nonlocal steps, batch_rows
        timers.on = not args.decode_only or all_decoding(llm.engine)
        steps += timers.on
        batch_rows += len(llm.engine.scheduler.running) if timers.on else 0
        return step()

    llm.engine.step = counted
    start = time.perf_counter()
    outs = llm.generate(random_prompts(8, batch, vocab, *lengths), params)
    wall = time.perf_counter() - start
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    timed_tokens = batch_rows if args.decode_only else tokens  # a decode step: one each
    cpu = dict(timers.cpu)
    cpu["other"] = cpu.pop("step")
    wall_parts = dict(timers.wall)
    wall_parts["other"] = wall_parts.pop("step")
    return {
        "steps": steps,
        "tokens": tokens,
        "tok_s": tokens / wall,
        "decode_batch_mean": batch_rows / max(steps, 1),
        "cpu_us_per_step": {k: 1e6 * v / steps for k, v in cpu.items()},
        "wall_us_per_step": {k: 1e6 * v / steps for k, v in wall_parts.items()},
        "cpu_us_per_token": 1e6 * sum(cpu.values()) / timed_tokens,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True")
    ap.add_argument("--label", default="current")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--prompt-len", type=int, default=0, help="0: 32-64 random ids")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--decode-only", action="store_true", help="time decode-only steps")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model = args.model or default_model()
    rows = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for name, temp in (("greedy", 0.0), ("T=0.8 top_p=0.9", 0.8)):
            rows[f"{batch} {name}"] = r = profile(model, batch, temp, args)
            parts = " ".join(f"{k}={v:.0f}" for k, v in r["cpu_us_per_step"].items())
            print(f"{batch} {name}: {r['cpu_us_per_token']:.0f} us CPU/token; per step {parts}")
            walls = " ".join(f"{k}={v:.0f}" for k, v in r["wall_us_per_step"].items())
            print(f"    {r['tok_s']:.0f} tok/s; wall per step {walls}")
    path = os.path.join(args.out, "step_profile.json")
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[args.label] = {
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg": os.getloadavg(),
        "eager": args.eager,
        "threads": args.threads,
        "prompt_len": args.prompt_len or "32-64",
        "kv_cache_dtype": args.kv_cache_dtype,
        "decode_only": args.decode_only,
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return data[args.label]


if __name__ == "__main__":
    main()
