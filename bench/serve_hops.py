"""Where served time goes: the same streaming workload entered at three depths of the stack.

- engine: the AsyncEngine in this process (no Ray, no HTTP): the ceiling;
- handle: a DeploymentHandle stream from this process (colocated: -> EngineServer;
  disaggregated: -> PrefillServer.prefill, then -> DecodeServer.generate), no proxy/ingress;
- http: the OpenAI API (proxy -> Ingress -> replicas), through bench/sse_client.py.

For every depth and concurrency: output tok/s, TTFT p50, TPOT p50, and for the Serve runs
the CPU each process role used per output token (proxy, ingress, replicas, Ray's own
processes, this client), found by process title. One engine thread everywhere.

    python bench/serve_hops.py [--mode colocated|disaggregated] [--levels 1,8,32]
        [--delta-channel socket|serve] [--depths engine,handle,http]

Writes bench/results/serve_hops_<mode>.json (serve_hops_<mode>_<channel>.json when
--delta-channel is given). The handle depth always streams through Serve (`generate`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import RESULTS, default_model, write_json  # noqa: E402
from bench.peer import machine_conditions, median, random_prompts  # noqa: E402
from bench.sse_client import closed_loop  # noqa: E402

PORT, PROMPT_LEN, GEN = 8813, 64, 64
ROLES = ("ProxyActor", "Ingress", "EngineServer", "PrefillServer", "DecodeServer", "KVStore")
ROLES += ("ServeController", "raylet", "gcs_server")


def role_of(proc) -> str | None:
    try:
        text = " ".join(proc.cmdline()) or proc.name()
    except Exception:  # noqa: BLE001 - gone or not ours
        return None
    if proc.pid == os.getpid():
        return "client+driver"
    return next((r for r in ROLES if r in text), "other ray" if "ray" in text else None)


def cpu_by_role() -> dict[str, float]:
    """CPU seconds per role over this process and its descendants: the local Ray cluster
    that ray.init started here (other Ray clusters on the machine are not counted)."""
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for p in [me, *me.children(recursive=True)]:
        role = role_of(p)
        if role is None:
            continue
        try:
            t = p.cpu_times()
        except Exception:  # noqa: BLE001
            continue
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


async def timed_stream(deltas, start: float) -> dict:
    stamps, tokens = [], 0
    async for d in deltas:
        if d.new_token_ids:
            stamps.append(time.perf_counter() - start)
            tokens += len(d.new_token_ids)
    return {"ttft": stamps[0], "tokens": tokens, "tpot": (stamps[-1] - stamps[0]) / (tokens - 1)}


async def loop(one, prompts, concurrency: int) -> dict:
    """Closed loop over `one(prompt) -> {ttft, tokens, tpot}`."""
    queue, results = list(prompts), []

    async def worker():
        while queue:
            results.append(await one(queue.pop()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {
        "output_tokens": sum(r["tokens"] for r in results),
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": median([r["ttft"] for r in results]),
        "tpot_p50_s": median([r["tpot"] for r in results]),
    }


def params():
    from app import SamplingParams

    return SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)


def engine_depth(model: str, prompts, c: int) -> dict:
    import torch

    from app.config import CacheConfig, EngineConfig
    from app.engine.async_engine import AsyncEngine
    from app.engine.engine import Engine
    from app.engine.request import Request

    torch.set_num_threads(1)
    cache = CacheConfig(kv_cache_dtype="fp8_e4m3", kv_cache_memory_bytes=64 << 20)
    engine = AsyncEngine(Engine(EngineConfig(model=model, dtype="float32", cache=cache)))

    async def one(p):
        req = Request(uuid.uuid4().hex, p, params())
        return await timed_stream(engine.generate(req), time.perf_counter())

    return asyncio.run(loop(one, prompts, c))


def handle_depth(mode: str, prompts, c: int) -> dict:
    from ray import serve

    from app.serve.messages import (
        DecodeRequest,
        GenerateRequest,
        HandOff,
        HandOffStarted,
        RoutingInfo,
    )

    async def one(p):
        gen = GenerateRequest(uuid.uuid4().hex, p, params(), None, RoutingInfo(len(p)))
        start = time.perf_counter()
        if mode == "colocated":
            h = serve.get_deployment_handle("EngineServer", "hops")
            return await timed_stream(h.options(stream=True).generate.remote(gen), start)
        prefill = serve.get_deployment_handle("PrefillServer", "hops").options(stream=True)
        items = prefill.prefill.remote(gen)
        async for item in items:  # the first token (after an overlapped hand-off's start)
            if not isinstance(item, HandOffStarted):
                break
        first = time.perf_counter() - start
        async for _ in items:  # its result, posted to the hand-off box
            pass
        dec = serve.get_deployment_handle("DecodeServer", "hops").options(stream=True)
        message = DecodeRequest(gen, HandOff(gen.request_id), gen.routing)
        rest = await timed_stream(dec.generate.remote(message), start)
        return {"ttft": first, "tokens": rest["tokens"] + 1, "tpot": rest["tpot"]}

    return asyncio.run(loop(one, prompts, c))


def with_cpu(run) -> dict:
    before, t = cpu_by_role(), time.perf_counter()
    out = run()
    wall, after = time.perf_counter() - t, cpu_by_role()
    tokens = out["output_tokens"]
    out["cpu_us_per_token"] = {
        r: round((after[r] - before.get(r, 0.0)) / tokens * 1e6) for r in sorted(after)
    }
    out["cores_total"] = round(sum(after[r] - before.get(r, 0.0) for r in after) / wall, 2)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"])
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--delta-channel", default=None, choices=["socket", "serve"])
    ap.add_argument("--depths", default="engine,handle,http")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    depths = set(args.depths.split(","))
    import ray
    from ray import serve

    from app.config import ModelConfig
    from app.serve.build import build_app

    model = args.model or default_model()
    vocab = ModelConfig.from_path(model).vocab_size
    levels = [int(x) for x in args.levels.split(",")]
    batches = {c: random_prompts(c, max(8, 3 * c), vocab, PROMPT_LEN, PROMPT_LEN) for c in levels}
    rows: dict = {"engine": {}, "handle": {}, "http": {}}
    for c in levels if "engine" in depths else []:
        rows["engine"][str(c)] = with_cpu(lambda c=c: engine_depth(model, batches[c], c))
        print("engine", c, json.dumps(rows["engine"][str(c)]), flush=True)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT})
        app_args = {"mode": args.mode, "engine": {"model": model, "torch_threads": 1}}
        if args.delta_channel:
            app_args["delta_channel"] = args.delta_channel
        serve.run(build_app(app_args), name="hops", route_prefix="/")
        url = f"http://127.0.0.1:{PORT}"
        name = os.path.basename(model.rstrip("/"))
        warm = random_prompts(99, 4, vocab, PROMPT_LEN, PROMPT_LEN)
        asyncio.run(closed_loop(url, name, warm, 1, GEN, 120))
        for c in levels:
            if "handle" in depths:
                handle = lambda c=c: handle_depth(args.mode, batches[c], c)  # noqa: E731
                rows["handle"][str(c)] = with_cpu(handle)
                print("handle", c, json.dumps(rows["handle"][str(c)]), flush=True)
            if "http" in depths:
                http = lambda c=c: asyncio.run(closed_loop(url, name, batches[c], c, GEN, 300))  # noqa: E731
                rows["http"][str(c)] = with_cpu(http)
                print("http", c, json.dumps(rows["http"][str(c)]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"mode": args.mode, "model": model, "conditions": machine_conditions(), **rows}
    result["delta_channel"] = args.delta_channel or "default"
    suffix = f"_{args.delta_channel}" if args.delta_channel else ""
    write_json(f"serve_hops_{args.mode}{suffix}", result, out_dir=args.out)
    return result


if __name__ == "__main__":
    main()
