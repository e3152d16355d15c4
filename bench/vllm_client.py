"""vLLM's own serving benchmark (`vllm.benchmarks.serve`) as an independent client: run by
the peer venv's python (.venv-vllm), against any OpenAI-compatible server. Its random
dataset decodes random token ids to text with the model's tokenizer and sends the text to
/v1/completions (streaming, `ignore_eos`), so both servers see the same prompts.

    .venv-vllm/bin/python bench/vllm_client.py --base-url URL --model NAME --tokenizer PATH \
        --input-len 1000 --output-len 64 --num-prompts 192 --concurrency 32 --seed 1

Prints one JSON line: the benchmark's own result (output_throughput, median_ttft_ms, ...).
bench/serve_vs_vllm.py runs it beside its own client (bench/sse_client.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# The keys of vLLM's result that bench/serve_vs_vllm.py reads, and its names for them.
KEYS = {
    "output_throughput": "output_tok_s",
    "median_ttft_ms": "ttft_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "median_itl_ms": "itl_p50_ms",
    "median_tpot_ms": "tpot_p50_ms",
    "completed": "completed",
    "failed": "failed",
    "duration": "wall_s",
    "total_output_tokens": "output_tokens",
}


def bench_args(a: argparse.Namespace, out_dir: str) -> list[str]:
    return [
        "--backend", "openai", "--base-url", a.base_url, "--endpoint", "/v1/completions",
        "--model", a.model, "--tokenizer", a.tokenizer, "--dataset-name", "random",
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-range-ratio", "0", "--num-prompts", str(a.num_prompts),
        "--max-concurrency", str(a.concurrency), "--seed", str(a.seed), "--ignore-eos",
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl",
        "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result",
        "--result-dir", out_dir, "--result-filename", "result.json",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    for name in ("--base-url", "--model", "--tokenizer"):
        ap.add_argument(name, required=True)
    for name in ("--input-len", "--output-len", "--num-prompts", "--concurrency", "--seed"):
        ap.add_argument(name, type=int, required=True)
    a = ap.parse_args()
    from vllm.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    with tempfile.TemporaryDirectory() as out_dir:
        result = serve.main(parser.parse_args(bench_args(a, out_dir)))
    row = {ours: result.get(theirs) for theirs, ours in KEYS.items()}
    sys.stdout.flush()
    os.write(1, ("VLLM_CLIENT_RESULT " + json.dumps(row) + "\n").encode())


if __name__ == "__main__":
    main()
