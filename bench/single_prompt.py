"""Where a single long prompt's served TTFT goes, against the offline engine (issue 34's
"within 10 ms of the offline prefill").

    python bench/single_prompt.py [--mode colocated|disaggregated] [--prompt-len 1000]
        [--prompts 12] [--rounds 2] [--tag T]

Per round, alternated so both see the same box:
- offline, alone: `LLM` with the served engine options and the replica's threads, one
  prompt at a time (`max_tokens=1`), nothing else running;
- offline beside an idle `slimserve serve` (the Ray cluster, Serve's controller and proxy,
  the replicas' polling loops: what a served step shares the cores with), and the CPU that
  idle app's processes use (`idle_app`: cores over 10 s, in all and its busiest processes);
- served: the same prompts one at a time through the OpenAI API (stream, `max_tokens=1`),
  client TTFT; and the engine replica's own prefill step time, from the prefill rate it
  measured of its steps (`placement_load()`, app/engine/step_rates.py).

Each figure is the median over the prompts after the first two (warm-up). Writes
bench/results/single_prompt_<mode>[_<tag>].json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_json  # noqa: E402
from bench.peer import machine_conditions, median, random_prompts  # noqa: E402
from bench.serve_vs_vllm import Server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT, WARM = 8817, 2
REPLICA = {"colocated": "EngineServer", "disaggregated": "DecodeServer"}


def offline(prompt_len: int, n: int) -> dict:
    """In a fresh process (its own torch threads), as the replica: threads for every CPU."""
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from bench.single_prompt import _offline; "
    code += f"_offline({prompt_len}, {n})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _offline(prompt_len: int, n: int) -> None:
    import torch

    from app import LLM
    from app.assets import default_model_path
    from app.engine.sampling_params import SamplingParams
    from app.engine.step_threads import available_cpus
    from app.serve.config import SERVE_DEFAULTS

    torch.set_num_threads(available_cpus())
    llm = LLM(default_model_path(), **SERVE_DEFAULTS)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttft = []
    for prompt in random_prompts(7, n, 1000, prompt_len, prompt_len):
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        ttft.append(time.perf_counter() - t0)
    print(json.dumps({"ttft_p50_ms": 1e3 * median(ttft[WARM:])}))


def idle_app(root_pid: int, seconds: float = 10.0) -> dict:
    """Cores the app's process tree (Ray's own processes and the replicas) uses at rest;
    a process that ends within the window is left out."""
    import psutil

    procs = psutil.Process(root_pid).children(recursive=True) + [psutil.Process(root_pid)]
    before = {p.pid: _cpu(p) for p in procs}
    time.sleep(seconds)
    used = {}
    for p in procs:
        after = _cpu(p)
        if after is not None and before[p.pid] is not None:
            used[f"{p.pid} {_name(p)}"] = (after - before[p.pid]) / seconds
    busiest = sorted(used.items(), key=lambda kv: -kv[1])[:6]
    return {"cores": round(sum(used.values()), 3), "busiest": {k: round(c, 3) for k, c in busiest}}


def _cpu(proc) -> float | None:
    import psutil

    try:
        t = proc.cpu_times()
    except psutil.Error:  # gone
        return None
    return t.user + t.system


def _name(proc) -> str:
    import psutil

    try:
        return " ".join(proc.cmdline())[:80].strip()
    except psutil.Error:
        return "?"


def served(server: Server, mode: str, prompt_len: int, n: int) -> dict:
    import httpx

    ttft = []
    with httpx.Client(timeout=120) as client:
        for prompt in random_prompts(8, n, 1000, prompt_len, prompt_len):
            body = {"model": server.model, "prompt": prompt, "max_tokens": 1, "stream": True}
            t0, first = time.perf_counter(), None
            with client.stream("POST", server.url + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if first is None and line.startswith("data:") and '"text"' in line:
                        first = time.perf_counter() - t0
            if first is None:
                raise RuntimeError(f"no token streamed for a {prompt_len}-token prompt")
            ttft.append(first)
            time.sleep(0.2)  # one prompt at a time, as offline
    # in a process of its own: a driver's Serve handles outlive a cluster it reconnects to
    code = f"import sys; sys.path.insert(0, {ROOT!r}); from bench.single_prompt import _rate; "
    out = subprocess.run([sys.executable, "-c", code + f"_rate({REPLICA[mode]!r})"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    reported = out.stdout.strip().splitlines()[-1]
    if reported == "None":
        raise RuntimeError(f"{REPLICA[mode]} measured no prefill step of >= 64 tokens")
    rate = float(reported)
    return {"ttft_p50_ms": 1e3 * median(ttft[WARM:]), "replica_step_ms": 1e3 * prompt_len / rate}


def _rate(deployment: str) -> None:
    """The engine replica's measured prefill rate (a moving average over its steps)."""
    import ray
    from ray import serve

    ray.init(address="auto", namespace="serve", logging_level="ERROR")
    handle = serve.get_deployment_handle(deployment, "slimserve")
    print(handle.placement_load.remote().result()["prefill_rate"])


def one_round(args) -> dict:
    row = {"offline_alone": offline(args.prompt_len, args.prompts)}
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(PORT), "--grpc-port", "0"]
    server = Server(f"single-{args.mode}", cmd + ["--mode", args.mode], PORT, {"PYTHONPATH": ROOT})
    try:
        time.sleep(5)  # past the replicas' start-up work
        row["idle_app"] = idle_app(server.pid)
        row["offline_beside_idle_serve"] = offline(args.prompt_len, args.prompts)
        row["served"] = served(server, args.mode, args.prompt_len, args.prompts)
    finally:
        server.stop()
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="colocated", choices=sorted(REPLICA))
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    result = {"mode": args.mode, "prompt_len": args.prompt_len, "before": machine_conditions()}
    result["rounds"] = [one_round(args) for _ in range(args.rounds)]
    result["after"] = machine_conditions()
    write_json(f"single_prompt_{args.mode}" + (f"_{args.tag}" if args.tag else ""), result)
    return result


if __name__ == "__main__":
    main()
