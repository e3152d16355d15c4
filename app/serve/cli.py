"""`slimserve serve`: run the Serve application on a local Ray (default: deploy/local.yaml's)."""

from __future__ import annotations

import argparse
import signal
import threading

import yaml

GRPC_SERVICERS = "app.serve.grpc_servicer.add_slimserve_grpc_servicers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a deploy/*.yaml file; its first application's args are used")
    p.add_argument("--model", help="checkpoint folder (default: the embedded default model)")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--num-prefill-replicas", type=int)
    p.add_argument("--num-decode-replicas", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000, help="gRPC API port (0: no gRPC)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray")
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
    for name in ("mode", "num_prefill_replicas", "num_decode_replicas"):
        if getattr(args, name) is not None:
            cfg[name] = getattr(args, name)
    return cfg


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from app.serve.build import build_app
    from app.serve.config import ServeArgs

    cfg = ServeArgs(**serve_args(args))
    ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    grpc = {"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICERS]}
    serve.start(
        http_options={"host": args.host, "port": args.port},
        grpc_options=grpc if args.grpc_port else None,
    )
    serve.run(build_app(cfg), name="slimserve", route_prefix="/")
    print(f"slimserve: OpenAI API on http://{args.host}:{args.port}/v1 (Ctrl-C stops)")
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
