"""The overlapped KV hand-off, served: `slimserve serve` disaggregated with every prompt
prefilled on the prefill replica (`--local-prefill-max-tokens 0`), the overlapped hand-off
on (the default) and off (`overlap_hand_off: false`), alternated run by run on the
same box, with our streaming client (bench/sse_client.py).

Per prompt length and concurrency: TTFT p50, the time from the first token to the second
(the hand-off's tail after the first token: the rest of the export, the publish, the take,
the fetch and the import of what the parts did not carry), inter-token latency p50 and
output tok/s.

    python bench/handoff_overlap.py [--prompt-lens 600,1000] [--levels 1,8] [--runs 2]

Writes bench/results/handoff_overlap.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import bar_plot, write_json  # noqa: E402
from bench.peer import machine_conditions, median, random_prompts  # noqa: E402
from bench.serve_vs_vllm import ROOT, start_ours  # noqa: E402
from bench.sse_client import closed_loop  # noqa: E402

GEN = 16  # the default model's context is 1,024 tokens
VARIANTS = {"overlapped": True, "after the token": False}  # ServeArgs.overlap_hand_off


def variant_config(overlap: bool) -> str:
    """deploy/local.yaml with the overlapped hand-off on or off."""
    import yaml

    with open(os.path.join(ROOT, "deploy", "local.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["applications"][0]["args"]["overlap_hand_off"] = overlap
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="handoff_overlap_")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def one_run(name: str, overlap: bool, args, seed: int) -> dict:
    server = start_ours(None, "disaggregated-always", variant_config(overlap))
    cells = {}
    try:
        for plen in args.prompt_lens:
            for c in args.levels:
                n = max(args.min_requests, c * args.requests_per_stream)
                prompts = random_prompts(seed + plen + c, n + c, args.vocab, plen, plen)
                warm, rest = prompts[:c], prompts[c:]
                asyncio.run(closed_loop(server.url, server.model, warm, c, GEN, 120))
                cells[f"{plen}x{c}"] = asyncio.run(
                    closed_loop(server.url, server.model, rest, c, GEN, args.limit_s)
                )
    finally:
        server.stop()
    return {"variant": name, "cells": cells}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[600, 1000])  # fmt: skip
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--requests-per-stream", type=int, default=3)
    p.add_argument("--min-requests", type=int, default=12)
    p.add_argument("--limit-s", type=float, default=300)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--name", default="handoff_overlap")
    args = p.parse_args()
    runs = []
    for r in range(args.runs):
        for name, overlap in VARIANTS.items():  # alternated: the box's load drifts
            runs.append(one_run(name, overlap, args, seed=100 * r))
            print(runs[-1], flush=True)
    table = summary(runs)
    write_json(args.name, {"conditions": machine_conditions(), "gen": GEN, "runs": runs,
                           "median": table})  # fmt: skip
    plot(args.name, table)
    for cell, row in table.items():
        print(cell, row)


def summary(runs: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """cell -> variant -> the median over runs of each measure (ms, tok/s)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for run in runs:
        for cell, got in run["cells"].items():
            out.setdefault(cell, {}).setdefault(run["variant"], []).append(got)
    return {
        cell: {
            variant: {
                "ttft_p50_ms": 1e3 * median([g["ttft_p50_s"] for g in got]),
                "second_token_p50_ms": 1e3 * median([g["second_token_p50_s"] for g in got]),
                "itl_p50_ms": 1e3 * median([g["itl_p50_s"] for g in got]),
                "output_tok_s": median([g["output_tok_s"] for g in got]),
                "errors": sum(g["errors"] for g in got),
            }
            for variant, got in by_variant.items()
        }
        for cell, by_variant in out.items()
    }


def plot(name: str, table: dict) -> None:
    groups = {
        variant: {cell: table[cell][variant]["second_token_p50_ms"] for cell in table}
        for variant in VARIANTS
    }
    bar_plot(name, "first -> second token p50 (prompt tokens x streams)", groups, "ms")


if __name__ == "__main__":
    main()
