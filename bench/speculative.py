"""Speculative decoding (n-gram) on the default model: tokens per target forward and tok/s.

Two workloads, each a batch of prompts cut from the held-out text, greedy:
- repetitive: "repeat the passage": the passage, a blank line, then its first sentence
  again, so the continuation is a copy of text in the prompt (edits, quotes, code);
- plain: the beginning of a passage, continued freely.
For k = 1..5, with BF16/float32 or FP8 KV, and for two policies side by side:
- "acceptance": the proposer backs off only when its proposals are rejected
  (`cost_aware: false`);
- "cost": the default; speculation also pauses while verify steps cost more wall time per
  emitted token than plain decode steps (app/engine/spec/cost.py);
output tokens per target forward (per sequence: tokens emitted / forwards the sequence took
part in, the hardware-independent gain), tokens per second (wall clock, this machine; each
configuration runs alternately with plain decoding, ABAB, the fastest of --repeats runs of
each compared, so both see the same load; also the median of the per-pair ratios) and
the shares of decode steps the cost policy paused and spent probing. Every engine keeps its
state across the runs (warm-up, repeats, both workloads), as a server would. Greedy output
is checked to be identical to decoding without speculation in every configuration.

    python bench/speculative.py [--model PATH] [--gen 128] [--prompts 4] [--repeats 3]
    # quick: plain prompts, k = 1..3, the default policy, its own result file
    python bench/speculative.py --workloads plain --ks 1,2,3 --policies cost \
        --name speculative_plain
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import default_model, write_json  # noqa: E402

KV = {"native": "auto", "fp8": "fp8_e4m3"}
POLICIES = {"acceptance": False, "cost": True}  # name -> SpeculativeConfig.cost_aware


def passages(count: int, chars: int = 700) -> list[str]:
    from app.assets import default_heldout_path

    with open(default_heldout_path()) as f:
        text = f.read()
    step = len(text) // (count + 1)
    return [text[i * step : i * step + chars].split(". ", 1)[-1] for i in range(count)]


def workloads(tokenizer, count: int) -> dict[str, list[list[int]]]:
    texts = passages(count)
    rep = [t + "\n\n" + t.split(". ")[0] for t in texts]
    plain = [t[:300] for t in texts]
    return {
        "repetitive": [tokenizer.encode(p) for p in rep],
        "plain": [tokenizer.encode(p) for p in plain],
    }


def run(llm, prompts, gen: int) -> tuple[list[list[int]], float, float, float, float]:
    """-> (outputs, tokens per target forward per sequence, tokens per second, shares of
    the decode steps that the cost policy paused and spent (re)learning a kind's cost)."""
    from app import SamplingParams

    runner = llm.engine.runner
    forwards = steps = 0
    run_plan = runner.run
    before = llm.stats()

    def counting(plan):
        nonlocal forwards, steps
        forwards += len(plan.seq_lens)  # one forward pass of each scheduled sequence
        steps += 1
        return run_plan(plan)

    runner.run = counting
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t
    finally:
        runner.run = run_plan
    tokens = sum(len(o.token_ids) for o in outs)
    # the prefill forward of each prompt made its first token: count decode forwards only
    per_forward = (tokens - len(prompts)) / max(1, forwards - len(prompts))
    after = llm.stats()
    share = lambda key: (after.get(key, 0) - before.get(key, 0)) / max(1, steps - 1)  # noqa: E731
    paused, probing = share("spec_cost_paused_steps"), share("spec_cost_probe_steps")
    return [o.token_ids for o in outs], per_forward, tokens / wall, paused, probing


def side_by_side(n: int, base, llm, prompts, gen: int):
    """n runs of each engine, alternating, so that both see the same machine (it is
    shared); the fastest run of each counts. -> (base run, speculative run, median of the
    pairs' tok/s ratios, mean probing share of the speculative runs)."""
    pairs = [(run(base, prompts, gen), run(llm, prompts, gen)) for _ in range(n)]
    fastest = lambda runs: max(runs, key=lambda r: r[2])  # noqa: E731
    ratio = statistics.median(s[2] / b[2] for b, s in pairs)
    probing = statistics.fmean(s[4] for _, s in pairs)
    return fastest([b for b, _ in pairs]), fastest([s for _, s in pairs]), ratio, probing


def engines_for(model: str, kv: str, ks: list[int], policies: list[str]) -> dict:
    """(k, policy) -> LLM; k = 0: no speculation."""
    from app import LLM

    engines = {(0, "off"): LLM(model, kv_cache_dtype=kv)}
    for k in ks:
        for policy in policies:
            cost_aware = POLICIES[policy]
            spec = {"method": "ngram", "num_speculative_tokens": k, "cost_aware": cost_aware}
            engines[k, policy] = LLM(model, kv_cache_dtype=kv, speculative_config=spec)
    return engines


def measure(model: str, gen: int, count: int, ks: list[int], repeats: int, opts) -> dict:
    rows = []
    for kv_name, kv in KV.items():
        engines = engines_for(model, kv, ks, opts.policies.split(","))
        loads = workloads(engines[0, "off"].tokenizer, count)
        for name in opts.workloads.split(","):
            prompts = loads[name]
            for llm in engines.values():  # warm-up (and the prefix cache) on every engine
                llm.generate(prompts[:1], None)
            plain = engines[0, "off"]
            for (k, policy), llm in engines.items():
                base, mine, ratio, probing = side_by_side(repeats, plain, llm, prompts, gen)
                got, tpf, tps, paused, _ = base if k == 0 else mine
                ratio, probing = (1.0, 0.0) if k == 0 else (ratio, probing)
                assert got == base[0], f"speculation changed greedy output ({name}, k={k})"
                rows.append(
                    dict(kv=kv_name, workload=name, k=k, policy=policy, tokens_per_forward=tpf,
                         tok_s=tps, base_tok_s=base[2], paused_share=paused,
                         speedup_per_forward=tpf / base[1], speedup_tok_s=tps / base[2],
                         speedup_tok_s_pair_median=ratio, probing_share=probing)
                )  # fmt: skip
                print(
                    f"{kv_name:6} {name:10} k={k} {policy:10} tokens/forward {tpf:.2f} "
                    f"tok/s {tps:.0f} ({tps / base[2]:.2f}x, pairs {ratio:.2f}x) "
                    f"paused {paused:.0%} probing {probing:.1%}",
                    flush=True,
                )
    return {"model": model, "gen": gen, "prompts": count, "repeats": repeats, "rows": rows,
            "workloads": opts.workloads, "policies": opts.policies}  # fmt: skip


def plot(data: dict, out_dir: str, name: str = "speculative") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=False)
    for ax, metric, policy, label in (
        (axes[0], "speedup_per_forward", "cost", "tokens per target forward (x plain), cost-aware"),
        (axes[1], "speedup_tok_s", "acceptance", "tok/s (x plain), acceptance backoff only"),
        (axes[2], "speedup_tok_s", "cost", "tok/s (x plain), cost-aware (default)"),
    ):
        for kv in KV:
            for load, style in (("repetitive", "-o"), ("plain", "--s")):
                pts = [
                    r
                    for r in data["rows"]
                    if r["kv"] == kv and r["workload"] == load and r["policy"] in ("off", policy)
                ]
                ax.plot(
                    [r["k"] for r in pts], [r[metric] for r in pts], style, label=f"{load}, {kv} KV"
                )
        ax.axhline(1.0, color="grey", lw=0.8)
        if metric == "speedup_tok_s":
            ax.axhline(0.95, color="red", lw=0.6, ls=":")
        ax.set_xlabel("num_speculative_tokens k (0 = off)")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("n-gram speculative decoding, default model, greedy")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--ks", default="1,2,3,4,5")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell; the fastest counts")
    ap.add_argument("--workloads", default="repetitive,plain")
    ap.add_argument("--policies", default="acceptance,cost", help="acceptance and/or cost")
    ap.add_argument("--name", default="speculative", help="result file name (.json, .png)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from bench.common import RESULTS

    out = args.out or RESULTS
    ks = [int(k) for k in args.ks.split(",")]
    data = measure(args.model or default_model(), args.gen, args.prompts, ks, args.repeats, args)
    print(write_json(args.name, data, out), plot(data, out, args.name))
    return data


if __name__ == "__main__":
    main()
