"""`slimserve serve`: run the Serve application on a local Ray (default: deploy/local.yaml's)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

import yaml

GRPC_SERVICERS = "app.serve.grpc_servicer.add_slimserve_grpc_servicers"
# Who answers on --port / --grpc-port (docs/serving.md "Proxy"): HAProxy forwarding to the
# Ingress replicas' own HTTP and gRPC servers (Serve's direct ingress), or Serve's Python
# proxy actor. Ray reads the switch at import in every process, so it is set before Ray starts.
PROXIES = ("haproxy", "serve")
DEFAULT_PROXY = "haproxy"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a deploy/*.yaml file; its first application's args are used")
    p.add_argument("--model", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--num-prefill-replicas", type=int)
    p.add_argument("--num-decode-replicas", type=int)
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        help="disaggregated: prompts of at most this many tokens prefill on their decode "
        "replica (default: those under one KV chunk; 0: none)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000, help="gRPC API port (0: no gRPC)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray")
    p.add_argument(
        "--proxy",
        choices=PROXIES,
        default=DEFAULT_PROXY,
        help="haproxy: HAProxy in front of the Ingress replicas' own servers; "
        "serve: Serve's Python proxy actor (docs/serving.md)",
    )
    # Every engine option of app/config.py; given flags override the config file's engine:.
    from app.options import OPTIONS, add_engine_arguments
    from app.serve.config import SERVE_DEFAULTS

    add_engine_arguments(p, [name for name in OPTIONS if name != "model"], SERVE_DEFAULTS)


def serve_args(args: argparse.Namespace) -> dict:
    cfg: dict = {}
    if args.config:
        with open(args.config) as f:
            cfg = dict(yaml.safe_load(f)["applications"][0].get("args") or {})
    from app.options import given_options

    engine = dict(cfg.get("engine") or {}) | given_options(args)
    if args.model:
        engine["model"] = args.model
    cfg["engine"] = engine
    for name in ("mode", "num_prefill_replicas", "num_decode_replicas", "local_prefill_max_tokens"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    return cfg


def proxy_env(proxy: str) -> dict[str, str]:
    """The environment the local Ray must start with for `proxy`."""
    if proxy not in PROXIES:
        raise ValueError(f"proxy must be one of {PROXIES}, not {proxy!r}")
    return {HAPROXY_ENV: "1" if proxy == "haproxy" else "0"}


def use_proxy(proxy: str) -> None:
    """Sets `proxy`'s environment for this process and the Ray it starts (the workers inherit
    it). Ray Serve copies the switch into module constants at import, so a process that has
    already imported them with the other value cannot switch."""
    env = proxy_env(proxy)
    constants = sys.modules.get("ray.serve._private.constants")
    wanted = env[HAPROXY_ENV] == "1"
    if constants is not None and constants.RAY_SERVE_ENABLE_HA_PROXY is not wanted:
        raise RuntimeError(f"--proxy {proxy}: Ray Serve was imported with the other proxy")
    os.environ.update(env)


def run(args: argparse.Namespace) -> int:
    use_proxy(args.proxy)
    import ray
    from ray import serve

    from app.serve.build import build_app
    from app.serve.config import ServeArgs

    cfg = ServeArgs(**serve_args(args))
    # Always a new local Ray (never one found through RAY_ADDRESS or /tmp/ray): the proxy
    # switch above only holds for a Ray this process starts.
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False)
    grpc = {"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICERS]}
    serve.start(
        http_options={"host": args.host, "port": args.port},
        grpc_options=grpc if args.grpc_port else None,
    )
    serve.run(build_app(cfg), name="slimserve", route_prefix="/")
    print(f"slimserve: OpenAI API on http://{args.host}:{args.port}/v1 (Ctrl-C stops)")
    print(f"slimserve: proxy {args.proxy}")
    if args.grpc_port:
        print(f"slimserve: gRPC API (slimserve.v1.Generation) on port {args.grpc_port}")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
