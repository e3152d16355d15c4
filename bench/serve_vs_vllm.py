"""Served: slimserve's OpenAI API (`make serve` defaults: disaggregated; and colocated) vs
vLLM's OpenAI server (the peer), side by side, with one client (bench/sse_client.py).
`make serve`'s default prefills prompts under one KV chunk (these 64-token prompts) on the
decode replica (conditional disaggregation); mode `disaggregated-always` sends every prompt
through the prefill replica (`--local-prefill-max-tokens 0`), measuring the hand-off path.

Workload: streaming /v1/completions, 64-token prompts of random ids (fresh per run), 64 new
tokens, ignore_eos, temperature 0, closed loop at 1/8/32 concurrent streams. Each server
runs as its own process tree on 127.0.0.1 (`slimserve serve` exactly as `make serve` starts
it, plus `--mode colocated`; vLLM through `python -m vllm.entrypoints.openai.api_server`
from .venv-vllm, built on demand). vLLM stays up for the whole run; each slimserve mode is
started in turn, and at every level the two sides alternate (--runs each), waiting for both
to go idle before each run. The first request after each server's start is timed apart
(cold TTFT), then a few warm-up requests are sent.

    python bench/serve_vs_vllm.py [--model PATH] [--levels 1,8,32] [--runs 2] [--no-peer]

Writes bench/results/serve_vs_vllm.json and serve_vs_vllm.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, bar_plot, default_model, write_json  # noqa: E402
from bench.peer import (  # noqa: E402
    ROOT,
    CpuWindow,
    ensure_peer_venv,
    machine_conditions,
    random_prompts,
    settle,
)
from bench.sse_client import closed_loop, one_request  # noqa: E402

PEER_PORT, OUR_PORT = 8811, 8812
PROMPT_LEN, GEN = 64, 64
PEER_KV_BYTES = 256 << 20


class Server:
    """One server process tree on 127.0.0.1; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict | None = None):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(tempfile.gettempdir(), f"serve_vs_vllm_{name}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.pid = self.proc.pid
        self.model = self._wait_ready(limit_s=900)

    def _wait_ready(self, limit_s: float) -> str:
        deadline = time.time() + limit_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                    return json.loads(r.read())["data"][0]["id"]
            except OSError:
                time.sleep(2)
        raise TimeoutError(f"{self.name} not ready after {limit_s}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def start_peer(model: str) -> Server:
    py = ensure_peer_venv()
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(PEER_PORT), "--dtype", "float32"]
    cmd += ["--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(PEER_KV_BYTES)]
    cmd += ["--seed", "0"]
    return Server("vllm", cmd, PEER_PORT)


def start_ours(model: str | None, mode: str, config: str | None = None) -> Server:
    """`make serve` (= `slimserve serve`, defaults) on another port, without gRPC;
    config: a deploy/*.yaml instead of the default (A/B of settings)."""
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(OUR_PORT), "--grpc-port", "0"]
    cmd += ["--model", model] if model else []
    cmd += ["--config", config] if config else []
    if mode == "disaggregated-always":  # every prompt through a prefill replica
        cmd += ["--mode", "disaggregated", "--local-prefill-max-tokens", "0"]
    else:
        cmd += ["--mode", mode]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return Server(f"slimserve-{mode}", cmd, OUR_PORT, env)


def cold_and_warm(server: Server, vocab: int, seed: int, warmups: int = 4) -> dict:
    """TTFT of the first request after start, then warm-up requests (steady TTFT)."""
    import aiohttp

    async def go() -> list[dict]:
        async with aiohttp.ClientSession() as s:
            prompts = random_prompts(seed, warmups + 1, vocab, PROMPT_LEN, PROMPT_LEN)
            return [await one_request(s, server.url, server.model, p, GEN) for p in prompts]

    rs = asyncio.run(go())
    return {"first_ttft_s": rs[0].get("ttft"), "warm_ttft_s": [r.get("ttft") for r in rs[1:]]}


def run_level(server: Server, trees, c: int, vocab: int, seed: int, args) -> dict:
    n = max(args.min_requests, args.requests_per_stream * c)
    prompts = random_prompts(seed, n, vocab, PROMPT_LEN, PROMPT_LEN)
    waited = settle(trees, idle_cores=args.idle_cores, limit_s=10)
    with CpuWindow(trees) as cpu:
        out = asyncio.run(closed_loop(server.url, server.model, prompts, c, GEN, args.limit_s))
    out["cores"] = [round(x, 2) for x in cpu.cores]
    out["settle_s"] = round(waited, 2)
    print(f"  {server.name} c={c}: " + json.dumps({k: out[k] for k in list(out)[:12]}))
    return out


def compare_mode(peer: Server | None, mode: str, args, results: dict, seed: int) -> None:
    ours = start_ours(args.model, mode, args.config)
    try:
        sides = [s for s in (peer, ours) if s is not None]
        trees = [(s.pid, True) for s in sides]
        results["cold"][ours.name] = cold_and_warm(ours, args.vocab, seed)
        for c in args.levels:
            for r in range(args.runs):
                order = sides if r % 2 == 0 else sides[::-1]
                for side in order:
                    row = run_level(side, trees, c, args.vocab, seed + 10 * c + r, args)
                    row["cpu_trees"] = [s.name for s in sides]
                    results["levels"].setdefault(side.name, {}).setdefault(str(c), [])
                    results["levels"][side.name][str(c)].append(row)
    finally:
        ours.stop()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--runs", type=int, default=2, help="runs per server and level")
    ap.add_argument("--modes", default="disaggregated,disaggregated-always,colocated")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--limit-s", type=float, default=300.0, help="bound on one level's run")
    ap.add_argument("--idle-cores", type=float, default=0.3, help="'idle' for settle()")
    ap.add_argument("--no-peer", action="store_true", help="slimserve only (smoke test)")
    ap.add_argument("--config", default=None, help="slimserve's deploy/*.yaml (default: built in)")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    from app.config import ModelConfig

    args.levels = [int(x) for x in args.levels.split(",")]
    model_path = args.model or default_model()
    args.vocab = ModelConfig.from_path(model_path).vocab_size
    results: dict = {"cold": {}, "levels": {}, "conditions_before": machine_conditions()}
    peer = None if args.no_peer else start_peer(model_path)
    try:
        if peer is not None:
            results["cold"]["vllm"] = cold_and_warm(peer, args.vocab, 7)
        for i, mode in enumerate(args.modes.split(",")):
            compare_mode(peer, mode, args, results, 100 * (i + 1))
    finally:
        if peer is not None:
            peer.stop()
    results["conditions_after"] = machine_conditions()
    return publish(results, model_path, args)


def best(rows: list[dict], key: str) -> float:
    """The median over a level's runs (two runs: their mean)."""
    values = sorted(r[key] for r in rows)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def publish(results: dict, model_path: str, args) -> dict:
    table = {
        name: {
            c: {k: best(rows, k) for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")}
            for c, rows in levels.items()
        }
        for name, levels in results["levels"].items()
    }
    result = {
        "model": model_path,
        "workload": f"{PROMPT_LEN}-token random prompts, {GEN} new tokens, ignore_eos, "
        "temperature 0, streaming /v1/completions, closed loop",
        "peer_kv_cache_memory_bytes": PEER_KV_BYTES,
        "runs": args.runs,
        "summary": table,
        **results,
    }
    write_json("serve_vs_vllm", result, out_dir=args.out)
    series = {name: {c: v["output_tok_s"] for c, v in t.items()} for name, t in table.items()}
    bar_plot(
        "serve_vs_vllm", "Served output tok/s by concurrency", series, "tokens/s", out_dir=args.out
    )
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    """The docs/performance.md table of a result: per level, each server's median run."""
    t = result["summary"]
    ours = ("disaggregated", "disaggregated-always", "colocated")
    names = [n for n in [f"slimserve-{m}" for m in ours] + ["vllm"] if n in t]
    head = " | ".join(f"{n} tok/s, TTFT p50 / p99, ITL p50 (ms)" for n in names)
    lines = [f"| streams | {head} |", "|---:|" + "---:|" * len(names)]
    for c in t[names[0]]:
        cells = []
        for n in names:
            v = t[n][c]
            cells.append(
                f"{v['output_tok_s']:,.0f}, {v['ttft_p50_s'] * 1e3:.0f} / "
                f"{v['ttft_p99_s'] * 1e3:.0f}, {v['itl_p50_s'] * 1e3:.1f}"
            )
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    cold = result.get("cold", {})
    for n, v in cold.items():
        warm = [x for x in v["warm_ttft_s"] if x is not None]
        lines.append(
            f"\n{n}: first request after start TTFT {v['first_ttft_s'] * 1e3:.0f} ms, "
            f"then {', '.join(f'{x * 1e3:.0f}' for x in warm)} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
