"""Where a served token's CPU goes, per process: `slimserve serve` under closed-loop load,
each replica process sampled with py-spy (when the venv has it) while its CPU time is read.

    python bench/serve_profile.py [--mode colocated|disaggregated] [--levels 8,32]
        [--prompt-len 64] [--no-py-spy] [-- <extra slimserve serve flags>]

For each level: output tok/s, TTFT p50, CPU microseconds per output token of the Ingress and
of each engine replica process (PrefillServer, DecodeServer or EngineServer; main process
and threads), and py-spy's hottest frames per process (self and inclusive, % of the samples
taken while a thread was active). Writes bench/results/serve_profile_<mode>.json (--tag
names another file). The server is `slimserve serve` as `make serve` starts it, on port
8814, without gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, write_json  # noqa: E402
from bench.peer import ROOT, machine_conditions, random_prompts  # noqa: E402
from bench.serve_vs_vllm import GEN, Server, cold_and_warm  # noqa: E402
from bench.sse_client import closed_loop  # noqa: E402

PORT = 8814
ROLES = ("Ingress", "EngineServer", "PrefillServer", "DecodeServer")
TOP = 25


def replica_processes(root_pid: int) -> dict[str, object]:
    """role -> psutil.Process of the Serve replica (its title names the deployment)."""
    import psutil

    out = {}
    for p in psutil.Process(root_pid).children(recursive=True):
        text = " ".join(p.cmdline())
        role = next((r for r in ROLES if r in text and "ServeReplica" in text), None)
        if role is not None:
            out[role] = p
    return out


def hottest(raw_path: str) -> dict[str, list[tuple[str, float]]]:
    """py-spy's raw (collapsed-stack) output -> the TOP frames by self and inclusive %."""
    own, inclusive, total = collections.Counter(), collections.Counter(), 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            frames, n = stack.split(";"), int(count)
            total += n
            own[frames[-1]] += n
            for frame in set(frames):
                inclusive[frame] += n
    pct = lambda c: [(k, round(100 * v / max(1, total), 1)) for k, v in c.most_common(TOP)]  # noqa: E731
    return {"samples": total, "self_pct": pct(own), "inclusive_pct": pct(inclusive)}


def start_spies(procs: dict, workdir: str, level: int) -> dict[str, tuple]:
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return {}
    spies = {}
    for role, p in procs.items():
        out = os.path.join(workdir, f"{role}_{level}.txt")
        cmd = [spy, "record", "-p", str(p.pid), "-r", "200", "-f", "raw", "-o", out]
        cmd += ["--nonblocking"]
        spies[role] = (
            subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            out,
        )
    time.sleep(1.0)  # py-spy attaches
    return spies


def cpu_seconds(procs: dict) -> dict[str, float]:
    return {role: sum(p.cpu_times()[:2]) for role, p in procs.items()}


def run_level(server: Server, procs: dict, level: int, args, workdir: str) -> dict:
    n, plen = max(16, 4 * level), args.prompt_len
    prompts = random_prompts(100 + level, n, args.vocab, plen, plen)
    spies = start_spies(procs, workdir, level) if args.py_spy else {}
    before = cpu_seconds(procs)
    out = asyncio.run(closed_loop(server.url, server.model, prompts, level, GEN, 300.0))
    used = {r: c - before[r] for r, c in cpu_seconds(procs).items()}
    for proc, _ in spies.values():
        proc.send_signal(signal.SIGINT)
    for proc, _ in spies.values():
        proc.wait(timeout=60)
    tokens = max(1, out["output_tokens"])
    row = {k: out[k] for k in ("output_tok_s", "ttft_p50_s", "itl_p50_s", "tokens_per_event")}
    row["cpu_us_per_token"] = {r: round(1e6 * s / tokens, 1) for r, s in used.items()}
    row["cores"] = {r: round(s / out["wall_s"], 2) for r, s in used.items()}
    row["py_spy"] = {r: hottest(path) for r, (_, path) in spies.items() if os.path.exists(path)}
    print(
        f"{level} streams: {row['output_tok_s']:.0f} tok/s, cpu us/token {row['cpu_us_per_token']}"
    )
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    ap.add_argument("--levels", default="8,32")
    ap.add_argument("--vocab", type=int, default=1000, help="prompt ids drawn below this")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--no-py-spy", dest="py_spy", action="store_false")
    ap.add_argument("--tag", default=None, help="results file: serve_profile_<tag>.json")
    ap.add_argument("serve_flags", nargs="*", help="after --: more `slimserve serve` flags")
    args = ap.parse_args(argv)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(PORT), "--grpc-port", "0"]
    cmd += ["--mode", args.mode, *args.serve_flags]
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = {"mode": args.mode, "serve_flags": args.serve_flags, "before": machine_conditions()}
    server = Server(f"profile-{args.mode}", cmd, PORT, env)
    try:
        cold_and_warm(server, args.vocab, seed=1)
        procs = replica_processes(server.pid)
        with tempfile.TemporaryDirectory() as workdir:
            levels = [int(x) for x in args.levels.split(",")]
            result["levels"] = {str(c): run_level(server, procs, c, args, workdir) for c in levels}
    finally:
        server.stop()
    result["after"] = machine_conditions()
    write_json(f"serve_profile_{args.tag or args.mode}", result, RESULTS)
    return result


if __name__ == "__main__":
    main()
