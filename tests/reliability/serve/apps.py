"""One served app per test module (HTTP + gRPC on free loopback ports) and its handles."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import numpy as np
import ray
from ray import serve
from serve.apps import tiny_serve_args

# tests/grpc is not a package (it would shadow grpc): reuse its app helper by path.
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "grpc")
)
from grpc_app import grpc_app  # noqa: E402

from app import LLM, SamplingParams
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc


def prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 300, length)] for _ in range(n)]


def offline_texts(model: str, batch: list[list[int]], max_tokens: int) -> list[str]:
    """What an undisturbed run answers: the offline LLM, greedy, same FP8 KV, one batch."""
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_dtype="fp8_e4m3")
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.text for out in llm.generate(batch, params)]


@contextlib.contextmanager
def served_app(ray_session, model: str, name: str, deployments: tuple[str, ...], **args):
    """-> dict(url, stub, md, handles...) for `build_app(tiny_serve_args(model, **args))`."""
    md = (("application", name),)
    engine = {"dtype": "float32", **args.pop("engine", {})}
    cfg = tiny_serve_args(model, engine=engine, **args)
    with contextlib.ExitStack() as stack:
        for attempt in (0, 1):
            try:  # on a saturated machine Serve's controller may kill a proxy still starting
                channel, url = stack.enter_context(grpc_app(ray_session, cfg, name, md))
                break
            except ray.exceptions.RayActorError:
                if attempt:
                    raise
        app = {
            "url": url,
            "md": md,
            "args": cfg,
            "channel": channel,
            "stub": generation_pb2_grpc.GenerationStub(channel),
        }
        app |= {d: serve.get_deployment_handle(d, name) for d in deployments}
        yield app


def kill_replica(app_name: str, deployment: str) -> str:
    """Kills one Serve replica actor of `deployment` (no restart: Serve must replace it)."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    victim = next(a for a in actors if f"{app_name}#{deployment}#" in a["name"])
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    return victim["name"]


def wait_until(check, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < end, f"{what} not within {timeout_s} s"
        time.sleep(0.2)
