"""How close the prefill placement's TTFT estimates come to the TTFT served.

    python bench/placement_estimates.py [--config deploy/local.yaml] [--prompt-len 1000]
        [--levels 8,32] [--tag T] [-- <more slimserve serve flags>]

Starts `slimserve serve` (disaggregated) and runs closed loops of streaming requests of
--prompt-len random tokens at each level. After each level it scrapes the app's metrics
from Ray's metrics endpoint: the Ingress's placements (where and why), the p50 of its TTFT
estimates per side (`slimserve:prefill_placement_ttft_estimate_seconds`, from the histogram
buckets, as Prometheus' `histogram_quantile` would) and of the TTFT it measured
(`slimserve:time_to_first_token_seconds`, role ingress), each over that level alone.
Writes bench/results/placement_estimates[_<tag>].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import scrape_slimserve, write_json  # noqa: E402
from bench.peer import machine_conditions, random_prompts  # noqa: E402
from bench.serve_vs_vllm import Server, cold_and_warm  # noqa: E402
from bench.sse_client import closed_loop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT, GEN = 8819, 64
ESTIMATE = "ray_slimserve_prefill_placement_ttft_estimate_seconds_bucket"
TTFT = "ray_slimserve_time_to_first_token_seconds_bucket"
PLACEMENTS = "ray_slimserve_prefill_placements_total"


def metrics_port() -> int:
    """Ray's metrics endpoint of the server's node (a driver process of its own: a driver's
    Ray connection outlives nothing here)."""
    code = "import ray; ray.init(address='auto', logging_level='ERROR'); "
    code += "print(ray.nodes()[0]['MetricsExportPort'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def totals(samples, name: str, key: str, **match) -> dict[str, float]:
    """Sums of ``name``'s samples by the value of label ``key`` (those matching ``match``)."""
    out: dict[str, float] = {}
    for n, labels, value in samples:
        if n == name and all(labels.get(k) == v for k, v in match.items()):
            out[labels.get(key, "")] = out.get(labels.get(key, ""), 0.0) + value
    return out


def quantile(buckets: dict[str, float], q: float) -> float | None:
    """histogram_quantile over cumulative buckets {le: count} (linear within a bucket)."""
    edges = sorted((float(le), c) for le, c in buckets.items())
    if not edges or edges[-1][1] <= 0:
        return None
    rank, lower, below = q * edges[-1][1], 0.0, 0.0
    for le, count in edges:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = le, count
    return lower


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def level_row(server: Server, port: int, args, level: int) -> dict:
    n = max(16, 4 * level)
    prompts = random_prompts(300 + level, n, 1000, args.prompt_len, args.prompt_len)
    before = scrape_slimserve(port)
    out = asyncio.run(closed_loop(server.url, server.model, prompts, level, GEN, 300.0))
    time.sleep(12)  # Ray exports every few seconds
    after = scrape_slimserve(port)
    row = {"client_ttft_p50_s": out["ttft_p50_s"], "output_tok_s": out["output_tok_s"]}
    placed = delta(totals(after, PLACEMENTS, "reason"), totals(before, PLACEMENTS, "reason"))
    row["placements_by_reason"] = {k: v for k, v in placed.items() if v}
    row["placements_counted"] = sum(placed.values()) == n  # this level's requests alone
    for where in ("local", "remote"):
        buckets = delta(
            totals(after, ESTIMATE, "le", where=where), totals(before, ESTIMATE, "le", where=where)
        )
        row[f"estimate_p50_s_{where}"] = quantile(buckets, 0.5)
    ingress = {"role": "ingress"}
    ttft = delta(totals(after, TTFT, "le", **ingress), totals(before, TTFT, "le", **ingress))
    row["ingress_ttft_p50_s"] = quantile(ttft, 0.5)
    print(level, json.dumps(row), flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=None, help="a deploy/*.yaml (default: built in)")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--levels", default="8,32")
    ap.add_argument("--tag", default=None)
    ap.add_argument("serve_flags", nargs="*", help="after --: more `slimserve serve` flags")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(PORT), "--grpc-port", "0"]
    cmd += ["--mode", "disaggregated", *(["--config", args.config] if args.config else [])]
    cmd += args.serve_flags
    result = {"config": args.config, "serve_flags": args.serve_flags}
    result["before"] = machine_conditions()
    server = Server("placement-estimates", cmd, PORT, {"PYTHONPATH": ROOT})
    try:
        cold_and_warm(server, 1000, seed=1)
        port = metrics_port()
        time.sleep(12)  # the warm-up requests' metrics exported before the first baseline
        levels = [int(x) for x in args.levels.split(",")]
        result["levels"] = {str(c): level_row(server, port, args, c) for c in levels}
    finally:
        server.stop()
    result["after"] = machine_conditions()
    write_json("placement_estimates" + (f"_{args.tag}" if args.tag else ""), result)
    return result


if __name__ == "__main__":
    main()
