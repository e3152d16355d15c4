"""Served: slimserve's OpenAI API (`make serve` defaults: disaggregated; and colocated) vs
vLLM's OpenAI server (the peer), side by side, with two clients: ours (bench/sse_client.py)
and vLLM's own serving benchmark (bench/vllm_client.py, run from .venv-vllm).

Workload: streaming /v1/completions, random prompts of each --prompt-lens length (fresh per
run), 64 new tokens, ignore_eos, temperature 0, closed loop at 1/8/32 concurrent streams.
Each server runs as its own process tree on 127.0.0.1 (`slimserve serve` exactly as `make
serve` starts it, plus `--mode colocated`; vLLM through `python -m
vllm.entrypoints.openai.api_server` from .venv-vllm, built on demand). vLLM stays up for the
whole run; each slimserve mode is started in turn, and at every (length, level, client) the
two sides alternate (--runs each), waiting for both to go idle before each run.

Modes: `disaggregated` and `colocated` (the defaults of `make serve`);
`disaggregated-always` sends every prompt through the prefill replica
(`--local-prefill-max-tokens 0`); a `+socket` or `+serve` suffix sets `delta_channel`,
`+serve` with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Serve's by-value gRPC transport).

    python bench/serve_vs_vllm.py [--prompt-lens 128,512,1000] [--levels 1,8,32]
        [--modes disaggregated,colocated] [--clients ours,vllm] [--runs 1] [--no-peer]

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
GEN = 64
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
    base, _, transport = mode.partition("+")
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(OUR_PORT), "--grpc-port", "0"]
    cmd += ["--model", model] if model else []
    if transport:
        config = transport_config(config, transport)
    cmd += ["--config", config] if config else []
    if base == "disaggregated-always":  # every prompt through a prefill replica
        cmd += ["--mode", "disaggregated", "--local-prefill-max-tokens", "0"]
    else:
        cmd += ["--mode", base]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if transport == "serve":  # Serve's by-value gRPC handle calls, no user-code thread
        env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    return Server(f"slimserve-{mode}", cmd, OUR_PORT, env)


def transport_config(config: str | None, transport: str) -> str:
    """A copy of `config` (default deploy/local.yaml) with its delta channel `transport`."""
    import yaml

    with open(config or os.path.join(ROOT, "deploy", "local.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["applications"][0]["args"]["delta_channel"] = transport
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix=f"serve_vs_vllm_{transport}_")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def cold_and_warm(server: Server, vocab: int, seed: int, warmups: int = 4) -> dict:
    """TTFT of the first request after start, then warm-up requests (steady TTFT)."""
    import aiohttp

    async def go() -> list[dict]:
        async with aiohttp.ClientSession() as s:
            prompts = random_prompts(seed, warmups + 1, vocab, 64, 64)
            return [await one_request(s, server.url, server.model, p, GEN) for p in prompts]

    rs = asyncio.run(go())
    return {"first_ttft_s": rs[0].get("ttft"), "warm_ttft_s": [r.get("ttft") for r in rs[1:]]}


def ours_client(server: Server, plen: int, c: int, n: int, seed: int, args) -> dict:
    prompts = random_prompts(seed, n, args.vocab, plen, plen)
    return asyncio.run(closed_loop(server.url, server.model, prompts, c, GEN, args.limit_s))


def vllm_client(server: Server, plen: int, c: int, n: int, seed: int, args) -> dict:
    """vLLM's own benchmark (bench/vllm_client.py) in the peer venv; its numbers in our
    units (seconds, tok/s)."""
    cmd = [ensure_peer_venv(), os.path.join(ROOT, "bench", "vllm_client.py")]
    cmd += ["--base-url", server.url, "--model", server.model, "--tokenizer", args.model_path]
    cmd += ["--input-len", str(plen), "--output-len", str(GEN), "--num-prompts", str(n)]
    cmd += ["--concurrency", str(c), "--seed", str(seed)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit_s + 120)
    line = next((x for x in done.stdout.splitlines() if x.startswith("VLLM_CLIENT_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM client failed on {server.name}: {done.stderr[-2000:]}")
    r = json.loads(line.split(" ", 1)[1])
    ms = lambda k: r[k] / 1e3 if r.get(k) is not None else None  # noqa: E731
    return {
        "concurrency": c,
        "requests": (r["completed"] or 0) + (r["failed"] or 0),
        "errors": r["failed"] or 0,
        "wall_s": r["wall_s"],
        "output_tokens": r["output_tokens"],
        "output_tok_s": r["output_tok_s"],
        "ttft_p50_s": ms("ttft_p50_ms"),
        "ttft_p99_s": ms("ttft_p99_ms"),
        "itl_p50_s": ms("itl_p50_ms"),
        "tpot_p50_s": ms("tpot_p50_ms"),
    }


CLIENTS = {"ours": ours_client, "vllm": vllm_client}


def run_level(server: Server, trees, cell: tuple[str, int, int], seed: int, args) -> dict:
    client, plen, c = cell
    n = max(args.min_requests, args.requests_per_stream * c)
    waited = settle(trees, idle_cores=args.idle_cores, limit_s=10)
    with CpuWindow(trees) as cpu:
        out = CLIENTS[client](server, plen, c, n, seed, args)
    out["cores"] = [round(x, 2) for x in cpu.cores]
    out["settle_s"] = round(waited, 2)
    keys = ("output_tok_s", "ttft_p50_s", "itl_p50_s", "errors")
    print(f"  {server.name} {client} len={plen} c={c}: " + json.dumps({k: out[k] for k in keys}))
    return out


def compare_mode(peer: Server | None, mode: str, args, results: dict, seed: int) -> None:
    ours = start_ours(args.model, mode, args.config)
    try:
        sides = [s for s in (peer, ours) if s is not None]
        trees = [(s.pid, True) for s in sides]
        results["cold"][ours.name] = cold_and_warm(ours, args.vocab, seed)
        for plen in args.prompt_lens:
            for c in args.levels:
                for client in args.clients:
                    for r in range(args.runs):
                        order = sides if r % 2 == 0 else sides[::-1]
                        for side in order:
                            cell_seed = seed + 1000 * plen + 10 * c + r
                            row = run_level(side, trees, (client, plen, c), cell_seed, args)
                            row["cpu_trees"] = [s.name for s in sides]
                            # the peer's runs are kept per mode: each mode's ratios use
                            # the vLLM runs that alternated with it
                            name = ours.name if side is ours else f"vllm|{mode}"
                            cell = results["levels"].setdefault(name, {})
                            cell = cell.setdefault(client, {}).setdefault(str(plen), {})
                            cell.setdefault(str(c), []).append(row)
    finally:
        ours.stop()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--prompt-lens", default="128,512,1000")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--runs", type=int, default=1, help="runs per server, cell and client")
    ap.add_argument("--modes", default="disaggregated,colocated")
    ap.add_argument("--clients", default="ours,vllm")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--limit-s", type=float, default=300.0, help="bound on one level's run")
    ap.add_argument("--idle-cores", type=float, default=0.3, help="'idle' for settle()")
    ap.add_argument("--no-peer", action="store_true", help="slimserve only (smoke test)")
    ap.add_argument("--config", default=None, help="slimserve's deploy/*.yaml (default: built in)")
    ap.add_argument("--name", default="serve_vs_vllm", help="the result files' stem")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    from app.config import ModelConfig

    args.levels = [int(x) for x in args.levels.split(",")]
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    args.clients = args.clients.split(",")
    assert set(args.clients) <= set(CLIENTS), args.clients
    args.model_path = args.model or default_model()
    args.vocab = ModelConfig.from_path(args.model_path).vocab_size
    results: dict = {"cold": {}, "levels": {}, "conditions_before": machine_conditions()}
    peer = None if args.no_peer else start_peer(args.model_path)
    try:
        if peer is not None:
            results["cold"]["vllm"] = cold_and_warm(peer, args.vocab, 7)
        for i, mode in enumerate(args.modes.split(",")):
            compare_mode(peer, mode, args, results, 100 * (i + 1))
    finally:
        if peer is not None:
            peer.stop()
    results["conditions_after"] = machine_conditions()
    return publish(results, args)


METRICS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s")


def best(rows: list[dict], key: str) -> float | None:
    """The median over a cell's runs (two runs: their mean)."""
    values = sorted(r[key] for r in rows if r.get(key) is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summary(levels: dict) -> dict:
    """side -> client -> prompt length -> level -> {metric: median over runs}."""
    return {
        side: {
            client: {
                plen: {c: {k: best(rows, k) for k in METRICS} for c, rows in by_c.items()}
                for plen, by_c in by_len.items()
            }
            for client, by_len in by_client.items()
        }
        for side, by_client in levels.items()
    }


def publish(results: dict, args) -> dict:
    result = {
        "model": args.model_path,
        "workload": f"random prompts of {args.prompt_lens} tokens, {GEN} new tokens, "
        "ignore_eos, temperature 0, streaming /v1/completions, closed loop",
        "clients": args.clients,
        "peer_kv_cache_memory_bytes": PEER_KV_BYTES,
        "runs": args.runs,
        "summary": summary(results["levels"]),
        **results,
    }
    write_json(args.name, result, out_dir=args.out)
    series = {
        f"{side} {plen}": {c: v["output_tok_s"] for c, v in by_c.items()}
        for side, by_client in result["summary"].items()
        for plen, by_c in by_client.get(args.clients[0], {}).items()
    }
    bar_plot(
        args.name, f"Served output tok/s ({args.clients[0]} client)", series, "tokens/s",
        out_dir=args.out,
    )  # fmt: skip
    print(markdown(result))
    return result


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


# Issue 34's goals per cell, against the vLLM run beside the mode: tok/s at least vLLM's, TTFT
# p50 at most 1.2x (colocated) or 1.5x (disaggregated), and disaggregated ITL p50 at most 0.6x
# at long prompts (>= LONG_PROMPT tokens), the reason to disaggregate.
TOK_S_GOAL, ITL_GOAL, LONG_PROMPT = 1.0, 0.6, 512


def ttft_goal(mode: str) -> float:
    return 1.2 if mode.startswith("colocated") else 1.5


def bold_if(text: str, met: bool) -> str:
    return f"**{text}**" if met else text


def goal_cells(mode: str, plen: int, v: dict, p: dict) -> tuple[str, str, str]:
    """One level's three cells of the table, each bold where it meets its goal."""
    tok, ttft = v["output_tok_s"], v["ttft_p50_s"]
    their_tok, their_ttft = p.get("output_tok_s"), p.get("ttft_p50_s")
    itl, their_itl = v["itl_p50_s"], p.get("itl_p50_s")
    has_peer = bool(their_tok and their_ttft)
    itl_text = f"{ms(itl)} vs {ms(their_itl)}"
    itl_goal = mode.startswith("disaggregated") and plen >= LONG_PROMPT
    return (
        bold_if(ratio(tok, their_tok), has_peer and tok >= TOK_S_GOAL * their_tok),
        bold_if(ratio(ttft, their_ttft), has_peer and ttft <= ttft_goal(mode) * their_ttft),
        bold_if(itl_text, itl_goal and bool(their_itl) and itl <= ITL_GOAL * their_itl),
    )


def markdown(result: dict) -> str:
    """docs/performance.md's table: per (mode, client, length), slimserve vs vLLM at each level:
    tok/s ratio, TTFT p50 ratio, ITL p50 (ms) of both; bold where a cell meets its goal."""
    t = result["summary"]
    lines = [
        "| mode | client | prompt | tok/s vs vLLM | TTFT p50 vs vLLM | ITL p50 ms, ours vs vLLM |",
        "|---|---|---:|---|---|---|",
    ]
    for side in (s for s in t if not s.startswith("vllm|")):
        mode = side.removeprefix("slimserve-")
        peer = t.get(f"vllm|{mode}", {})
        for client, by_len in t[side].items():
            for plen, by_c in by_len.items():
                theirs = peer.get(client, {}).get(plen, {})
                cells = [goal_cells(mode, int(plen), v, theirs.get(c, {})) for c, v in by_c.items()]
                tok, ttft, itl = zip(*cells)
                row = f"{' / '.join(tok)} | {' / '.join(ttft)} | {'; '.join(itl)}"
                lines.append(f"| {mode} | {client} | {plen} | {row} |")
    levels = next(iter(next(iter(t.values())).values()), {})
    lines.append(f"\nlevels (concurrent streams): {' / '.join(next(iter(levels.values()), {}))}")
    return "\n".join(lines)


def ms(x: float | None) -> str:
    return f"{x * 1e3:.1f}" if x is not None else "-"


if __name__ == "__main__":
    main()
