"""Can a tenant tell from its time to first token whether another tenant sent a prompt?

Offline engine, default model, prefix caching on. For fresh 512-token prompts, the victim
sends P, then the prober sends P and we time the prober's first token, in four settings:
cold (nobody sent P), other tenant with per-tenant salts, other tenant without salts (the
shared cache), and the same tenant (a hit by design). Writes bench/results/tenant_timing.json.
Run: python -m bench.tenant_timing [--trials 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from app import LLM, SamplingParams
from app.assets import default_model_path

ONE = SamplingParams(temperature=0, max_tokens=1)
SETTINGS = {  # (victim salt, prober salt); None: no salt, "cold": the victim sends nothing
    "cold": ("cold", "tenant-b"),
    "other tenant, per-tenant salts": ("tenant-a", "tenant-b"),
    "other tenant, no salts": (None, None),
    "same tenant": ("tenant-a", "tenant-a"),
}


def ttft(llm: LLM, prompt: list[int], salt: str | None) -> float:
    start = time.perf_counter()
    llm.generate([prompt], ONE, cache_salt=salt)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()
    llm = LLM(default_model_path(), device="cpu", kv_cache_memory_bytes=64 << 20)
    rng = np.random.default_rng(0)
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.trials):
        for name, (victim, prober) in SETTINGS.items():
            prompt = [int(t) for t in rng.integers(10, 2000, args.tokens)]
            if victim != "cold":
                llm.generate([prompt], ONE, cache_salt=victim)
            times[name].append(ttft(llm, prompt, prober))
    cold = statistics.median(times["cold"])
    result = {
        name: {
            "median_ms": round(1e3 * statistics.median(t), 2),
            "p10_ms": round(1e3 * float(np.percentile(t, 10)), 2),
            "p90_ms": round(1e3 * float(np.percentile(t, 90)), 2),
            "median_vs_cold": round(statistics.median(t) / cold, 3),
        }
        for name, t in times.items()
    }
    result["setup"] = {"trials": args.trials, "prompt_tokens": args.tokens, "device": "cpu"}
    print(json.dumps(result, indent=2))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tenant_timing.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
