"""A running slimserve app on loopback, on the session's shared Ray."""

from __future__ import annotations

import contextlib
import time

from loopback import free_port

# One port per test process (Serve's HTTP options are fixed for its lifetime), so several
# test runs on one machine never answer each other's requests.
PORT = free_port()


def tiny_serve_args(model: str, **overrides) -> dict:
    engine = {
        "model": model,
        "kv_cache_dtype": "fp8_e4m3",
        "kv_cache_memory_bytes": 4 << 20,
        "block_size": 16,
        "chunk_tokens": 32,
        "torch_threads": 1,
        **overrides.pop("engine", {}),
    }
    return {
        "engine": engine,
        "served_model_name": "tiny",
        "store_capacity_bytes": 64 << 20,
        "routing_stats_period_s": 0.2,
        "allow_routing_hints": True,
        "api_key_cache_salts": {"key-tenant-a": "tenant-a", "key-tenant-b": "tenant-b"},
        "max_prompt_tokens": 400,
        # Placed by load on any box: on one with a single core even one thread per replica
        # shares it (tests/serve/disaggregated/test_shared_compute.py tests the default).
        "prefill_on_shared_compute": "load",
        **overrides,
    }


@contextlib.contextmanager
def running_app(ray_session, args: dict, name: str = "slimserve"):
    """serve.run(build_app(args)) on 127.0.0.1:PORT; deletes the app and store after."""
    import httpx
    from ray import serve

    from app.kvstore.handoff import box_name
    from app.kvstore.store import STORE_NAMESPACE, KVStoreClient
    from app.serve.build import build_app
    from app.serve.config import ServeArgs

    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    serve.run(build_app(args), name=name, route_prefix="/")
    _wait_healthy(httpx)
    try:
        yield f"http://127.0.0.1:{PORT}"
    finally:
        serve.delete(name)
        cfg = ServeArgs(**args)
        if cfg.mode == "disaggregated":
            with contextlib.suppress(Exception):
                for shard in KVStoreClient.from_name(cfg.store_name, cfg.store_shards).shards:
                    ray_session.kill(shard)
                box = box_name(cfg.store_name)
                ray_session.kill(ray_session.get_actor(box, namespace=STORE_NAMESPACE))


def _wait_healthy(httpx, deadline_s: float = 120) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError("the app did not become healthy")
