"""What one Ray Serve handle call costs before the callee runs, with no engine behind it:
Serve's default (by reference, a user-code thread and a router loop) and its
throughput-optimized transport (RAY_SERVE_THROUGHPUT_OPTIMIZED=1: by value over gRPC, no
separate thread or loop), each in a local Ray of its own.

A caller deployment sends bursts of 1 and 8 calls at once to a callee deployment (routed by
slimserve's `TokenAwareRouter`, as the engine replicas are) whose method only returns how
long after the caller placed it it was entered, then holds the call open (like a
long-lived `generate_to`). That entry latency is the "replica call placed -> generate_to
entered" stage of the served TTFT trace (docs/performance.md), measured without the model,
HTTP or token traffic: Serve's own share of it.

    python bench/serve_handle_hop.py [--bursts 10] [--env RAY_SERVE_X=0 ...]

Without --env it runs itself twice (default, then RAY_SERVE_THROUGHPUT_OPTIMIZED=1) and
writes both to bench/results/serve_handle_hop.json; --env sets Ray Serve switches for one
local Ray (e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_json  # noqa: E402
from bench.peer import machine_conditions, median, pct  # noqa: E402

HOLD_S = 0.3  # calls stay open this long after entry, so a burst's calls overlap


def deployments():
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    router = RequestRouterConfig(
        request_router_class="app.serve.routing.router:TokenAwareRouter",
        request_router_kwargs={"role": "prefill"},
        request_routing_stats_period_s=0.2,
    )

    @serve.deployment(max_ongoing_requests=32, request_router_config=router)
    class Callee:
        async def call(self, sent: float) -> float:
            entered = time.time() - sent
            await asyncio.sleep(HOLD_S)
            return entered

    @serve.deployment
    class Caller:
        def __init__(self, callee):
            self.callee = callee

        async def bursts(self, size: int, count: int) -> list[float]:
            await self.callee.call.remote(time.time())  # the router learns its replica
            out: list[float] = []
            for _ in range(count):
                calls = [self.callee.call.remote(time.time()) for _ in range(size)]
                out += await asyncio.gather(*calls)
                await asyncio.sleep(0.2)
            return out

    return Caller.bind(Callee.bind())


async def measure(caller, bursts: int) -> dict[int, dict]:
    """Awaited from a loop: a handle whose router shares its caller's loop
    (RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0) cannot be used from sync code."""
    rows = {}
    for size in (1, 8):
        ms = [x * 1e3 for x in await caller.bursts.remote(size, bursts)]
        row = {"calls": len(ms), "entry_ms_p50": median(ms), "entry_ms_p99": pct(ms, 0.99)}
        rows[f"serve/{size}"] = row
        print(f"burst of {size}: entered {row['entry_ms_p50']:.2f} ms p50 after placing")
    from ray import serve

    await serve.shutdown_async()  # on the loop the handle's router may live on
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bursts", type=int, default=10)
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the local Ray")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not args.env:
        return both(args)
    env = dict(kv.split("=", 1) for kv in args.env)
    os.environ.update(env)  # before Ray starts: its workers inherit it
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    conditions = machine_conditions()
    try:
        caller = serve.run(deployments(), name="hop", route_prefix=None)
        rows = asyncio.run(measure(caller, args.bursts))
    finally:
        ray.shutdown()
    result = {"env": env, "conditions": conditions, "bursts": args.bursts, "rows": rows}
    kwargs = {"out_dir": args.out} if args.out else {}
    write_json("serve_handle_hop", result, **kwargs)
    return result


def both(args) -> dict:
    """Serve's default and its throughput-optimized transport, each in its own process."""
    import json
    import subprocess
    import tempfile

    runs = {}
    for name, env in (("default", "RAY_SERVE_THROUGHPUT_OPTIMIZED=0"),
                      ("throughput_optimized", "RAY_SERVE_THROUGHPUT_OPTIMIZED=1")):  # fmt: skip
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, __file__, "--bursts", str(args.bursts), "--out", out]
            subprocess.run([*cmd, "--env", env], check=True)
            with open(os.path.join(out, "serve_handle_hop.json")) as f:
                runs[name] = json.load(f)
    kwargs = {"out_dir": args.out} if args.out else {}
    write_json("serve_handle_hop", runs, **kwargs)
    return runs


if __name__ == "__main__":
    main()
