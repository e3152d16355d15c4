"""Structured-output overhead on the offline engine (the default model, CPU): generation
tok/s with and without a JSON schema at 1, 8 and 32 concurrent requests, and grammar
compile time by schema size (cold, and a cache hit).

Both modes sample (temperature 1, seeded) the same prompts for at most --gen tokens; the
unconstrained run ignores EOS so it generates all of them. tok/s counts generated tokens
over wall time; the modes alternate round by round and each reports its median round, so
load from other processes on a shared machine hits both alike. `mask_share` is the part
of the wall time spent filling and applying token bitmasks (StructuredOutputs.mask).

    python bench/structured.py [--gen 64] [--concurrency 1,8,32] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, bar_plot, default_model, write_json  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}


def schema_of_size(num_props: int) -> dict:
    """An object with num_props properties of mixed kinds; every 4th is a nested object."""
    kinds = [
        {"type": "string", "maxLength": 16},
        {"type": "integer", "minimum": 0, "maximum": 1000},
        {"enum": ["a", "b", "c", "d"]},
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}}},
    ]
    props = {f"field_{i}": kinds[i % 4] for i in range(num_props)}
    return {"type": "object", "properties": props, "required": list(props)}


def run_once(llm, prompts: list[str], gen: int, spec, seed: int) -> tuple[int, float, float]:
    """-> (generated tokens, wall seconds, seconds spent masking) for one batch."""
    from app import SamplingParams

    structured = llm.engine.structured
    real_mask, spent = structured.mask, [0.0]

    def timed_mask(logits, seqs):
        t = time.perf_counter()
        real_mask(logits, seqs)
        spent[0] += time.perf_counter() - t

    structured.mask = timed_mask
    params = SamplingParams(
        temperature=1.0, seed=seed, max_tokens=gen, ignore_eos=spec is None, structured=spec
    )
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
    finally:
        structured.mask = real_mask
    return sum(len(o.token_ids) for o in outs), wall, spent[0]


def throughput(llm, concurrency: int, gen: int, spec, rounds: int) -> list[dict]:
    """Both modes, alternating round by round (a shared machine's load hits both alike);
    one row per mode with the median tok/s over the rounds."""
    modes = {"free text": None, "JSON schema": spec}
    runs: dict[str, list[tuple[int, float, float]]] = {m: [] for m in modes}
    for r in range(rounds + 1):  # round 0 warms up (and compiles the grammar)
        prompts = [f"Record {r}-{i} of the people:" for i in range(concurrency)]
        for mode, s in modes.items():
            result = run_once(llm, prompts, gen, s, seed=r)
            if r:
                runs[mode].append(result)
    rows = []
    for mode, results in runs.items():
        rows.append(
            {
                "concurrency": concurrency,
                "mode": mode,
                "tok_s": statistics.median(n / w for n, w, _ in results),
                "tokens": sum(n for n, _, _ in results),
                "seconds": sum(w for _, w, _ in results),
                "mask_share": sum(m for _, _, m in results) / sum(w for _, w, _ in results),
            }
        )
    return rows


def compile_times(tokenizer, vocab: int, eos, sizes: list[int]) -> list[dict]:
    import json

    from app.engine.structured import StructuredOutputSpec
    from app.engine.structured.compiler import GrammarCompiler

    rows = []
    for n in sizes:
        schema = schema_of_size(n)
        spec = StructuredOutputSpec.json_schema(schema)
        cold = []
        for _ in range(3):
            compiler = GrammarCompiler(tokenizer, vocab, eos)  # empty cache each time
            t = time.perf_counter()
            compiler.compile(spec)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            compiler.compile(spec)
            hit = time.perf_counter() - t
            compiler.shutdown()
        rows.append(
            {
                "properties": n,
                "schema_chars": len(json.dumps(schema)),
                "compile_ms": 1e3 * statistics.median(cold),
                "cache_hit_ms": 1e3 * hit,
            }
        )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1,4,16,64,256")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    from app import LLM
    from app.engine.structured import StructuredOutputSpec

    model = args.model or default_model()
    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=64, enable_prefix_caching=False)
    spec = StructuredOutputSpec.json_schema(PERSON)
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        for row in throughput(llm, c, args.gen, spec, args.rounds):
            rows.append(row)
            print(
                f"{c:>3} {row['mode']:12s} {row['tok_s']:8.1f} tok/s  mask {row['mask_share']:.1%}"
            )
    engine = llm.engine
    sizes = [int(x) for x in args.sizes.split(",")]
    compiles = compile_times(engine.tokenizer, engine.model_config.vocab_size,
                             tuple(engine.outputs.eos_ids), sizes)  # fmt: skip
    for r in compiles:
        hit = r["cache_hit_ms"]
        print(f"{r['properties']:>4} props {r['compile_ms']:8.1f} ms  (cache hit {hit:.3f} ms)")
    result = {
        "engine": "offline LLM (app.LLM), CPU, float32",
        "model": model,
        "gen": args.gen,
        "throughput": rows,
        "compile": compiles,
    }
    write_json("structured", result, args.out)
    groups = {
        name: {str(r["concurrency"]): r["tok_s"] for r in rows if r["mode"] == name}
        for name in ("free text", "JSON schema")
    }
    bar_plot("structured", "Generation tok/s, default model, CPU", groups, "tok/s", args.out)
    return result


if __name__ == "__main__":
    main()
