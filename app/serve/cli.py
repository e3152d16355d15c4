"""`slimserve serve`: run the Serve application on a local Ray (default: deploy/local.yaml's)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator

import yaml

from app.serve.reaper import WATCH_PERIOD_S, HAProxyWatch, LocalHead, unless_lost

GRPC_SERVICERS = "app.serve.grpc_api.grpc_servicer.add_slimserve_grpc_servicers"
# Who answers on --port / --grpc-port (docs/serving.md "Proxy"): HAProxy forwarding to the
# Ingress replicas' own HTTP and gRPC servers (Serve's direct ingress), or Serve's Python
# proxy actor. Ray reads the switch at import in every process, so it is set before Ray starts.
PROXIES = ("haproxy", "serve")
DEFAULT_PROXY = "haproxy"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# How long an Ingress replica behind HAProxy stays reachable once told to stop, so that load
# balancers in front can deregister it first (Ray's default, 30 s, was every Ctrl-C's wait).
# The CLI's Ray has one load balancer, its own HAProxy, stopped before Serve shuts down, and
# HAProxy retries a refused connection on another replica: 2 s, unless the variable is set.
DRAIN_ENV, LOCAL_DRAIN_S = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2"
# Ray's token authentication (docs/operations.md "Ray dashboard"): the mode, and where the
# token is read from: the variable, else the file the path names, else ~/.ray/auth_token.
AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV = (
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
)
DASHBOARD_PORT = 8265
METRICS_PORT = 9090
APP_NAME = "slimserve"
# Said at exit where the local Ray's head died first (app/serve/reaper.py, LocalHead)
RAY_GONE = "Ray's GCS or raylet had already exited"


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
    p.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the Ray dashboard (Serve tab: deployments, replicas, autoscaling); "
        "--no-dashboard: none (docs/operations.md)",
    )
    p.add_argument("--dashboard-host", default="127.0.0.1")
    p.add_argument(
        "--dashboard-port",
        type=int,
        help=f"default: {DASHBOARD_PORT}, or a free port if another Ray holds that one",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        help="also start Prometheus (Debian's `prometheus`) scraping this Ray, for the "
        "dashboard and slimserve's panels (app/serve/metrics_stack.py)",
    )
    p.add_argument("--metrics-port", type=int, default=METRICS_PORT, help="Prometheus' port")
    # Every engine option of app/config.py; given flags override the config file's engine:.
    from app.options import OPTIONS, add_engine_arguments
    from app.serve.config import SERVE_DEFAULTS

    add_engine_arguments(p, [name for name in OPTIONS if name != "model"], SERVE_DEFAULTS)


def first_application(path: str | None) -> dict:
    """The config file's first application (``{}`` without a file)."""
    if not path:
        return {}
    with open(path) as f:
        return dict(yaml.safe_load(f)["applications"][0])


def serve_args(args: argparse.Namespace) -> dict:
    cfg = dict(first_application(args.config).get("args") or {})
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
    os.environ.setdefault(DRAIN_ENV, LOCAL_DRAIN_S)  # read by the replicas, when they start


def application(args: argparse.Namespace) -> dict:
    """The Serve application to deploy, as `serve run <config>` would: the config file's
    first application (its ``deployments`` overrides, e.g. ``autoscaling_config``, included)
    with the command line's arguments."""
    from app.serve.config import ServeArgs

    raw = serve_args(args)
    ServeArgs(**raw)  # a bad argument fails here, before Ray starts
    deployments = first_application(args.config).get("deployments") or []
    return {
        "name": APP_NAME,
        "route_prefix": "/",
        "import_path": "app.serve.build:build_app",
        "args": raw,
        "deployments": deployments,
    }


def deploy(app: dict) -> None:
    """Deploy ``app`` through Serve's config path (what `serve run <config>` and `serve
    deploy` do, so ``deployments`` overrides apply) and wait until it runs."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))
    while True:
        status = serve.status().applications.get(APP_NAME)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"slimserve failed to deploy: {status.message}")
        time.sleep(0.5)


def dashboard_sign_in() -> str:
    """How to sign in to the dashboard under Ray's token authentication (on by default for a
    new local Ray since 2.60; RAY_AUTH_MODE=disabled turns it off)."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        return "no sign-in (token authentication is off)"
    if os.environ.get(AUTH_TOKEN_ENV):
        where = f"${AUTH_TOKEN_ENV}"
    else:
        where = os.environ.get(AUTH_TOKEN_PATH_ENV) or os.path.join("~", ".ray", "auth_token")
    return (
        f"sign in with the token in {where} (`ray get-auth-token` prints it): paste it into "
        "the dashboard's 'Authentication Token Required' dialog"
    )


def dashboard_port(args: argparse.Namespace) -> int:
    """The port asked for; by default 8265, or a free one when 8265 is taken (as by another
    `slimserve serve` on the machine): the printed URL says which."""
    if args.dashboard_port is not None:
        return args.dashboard_port
    with socket.socket() as s:
        try:
            s.bind((args.dashboard_host, DASHBOARD_PORT))
            return DASHBOARD_PORT
        except OSError:
            s.bind((args.dashboard_host, 0))
            return s.getsockname()[1]


def busy_ports(args: argparse.Namespace) -> str | None:
    """Why the fixed ports this server needs are not free, or None (app/serve/ports.py);
    asked before Ray starts, after the proxy switch is set."""
    from app.serve.ports import PortsInUse, check_free, listeners

    try:
        check_free(listeners(args.host, args.port, args.grpc_port, args.proxy == "haproxy"))
    except PortsInUse as e:
        return str(e)
    return None


def run(args: argparse.Namespace) -> int:
    use_proxy(args.proxy)
    import ray
    from ray import serve

    app = application(args)
    busy = busy_ports(args)
    if busy:
        sys.stderr.write(f"slimserve: {busy}\n")
        return 1
    prometheus_binary = None
    if args.metrics:  # checked before Ray starts; the dashboard reads the host at its start
        from app.serve.metrics_stack import PROMETHEUS_HOST_ENV, find_prometheus

        prometheus_binary = find_prometheus()
        os.environ[PROMETHEUS_HOST_ENV] = f"http://127.0.0.1:{args.metrics_port}"
    # Always a new local Ray (never one found through RAY_ADDRESS or /tmp/ray): the proxy
    # switch above only holds for a Ray this process starts.
    ctx = ray.init(
        address="local",
        num_cpus=args.num_cpus,
        include_dashboard=args.dashboard,
        dashboard_host=args.dashboard_host,
        dashboard_port=dashboard_port(args) if args.dashboard else None,
    )
    # Printed before the app deploys: the dashboard shows it starting (model loading included).
    if args.dashboard:
        say(f"Ray dashboard on http://{ctx.dashboard_url}/#/serve")
        say(f"dashboard {dashboard_sign_in()}")
    logs = os.path.join(ctx.address_info["session_dir"], "logs")
    say(f"Ray logs in {logs} (autoscaling decisions: serve/controller_*.log)")
    prometheus, proxies, head = None, HAProxyWatch(), LocalHead()
    signal.signal(signal.SIGTERM, _stopped)  # replaces the handler ray.init installed
    try:
        with until_stopped():
            if args.metrics:
                from app.serve.metrics_stack import Prometheus, ray_metrics_targets

                metrics = ray_metrics_targets()
                prometheus = Prometheus(args.metrics_port, metrics, prometheus_binary)
            grpc = {"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICERS]}
            serve.start(
                http_options={"host": args.host, "port": args.port},
                grpc_options=grpc if args.grpc_port else None,
            )
            deploy(app)
            say(f"OpenAI API on http://{args.host}:{args.port}/v1 (Ctrl-C stops)")
            say(f"proxy {args.proxy}")
            if args.grpc_port:
                say(f"gRPC API (slimserve.v1.Generation) on port {args.grpc_port}")
            if prometheus is not None:
                say(f"Prometheus on {prometheus.url} (scraping this Ray)")
                say(f"slimserve panels on {prometheus.console_url}")
            while True:
                time.sleep(WATCH_PERIOD_S)
                proxies.update()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut it short
        proxies.stop()  # first, as Serve's shutdown would (app/serve/reaper.py)
        ray_gone = False
        try:
            ray_gone = not unless_lost(head, serve.shutdown)
            if not ray_gone:
                ray.shutdown()
        finally:
            if prometheus is not None:
                prometheus.stop()
        if ray_gone:
            say(f"{RAY_GONE} (its process group was signalled): no shutdown left to run")
            sys.stderr.flush()
            os._exit(0)  # Ray's exit hook would ask the dead GCS for ~8 s
    return 0


class Stopped(Exception):
    """SIGTERM, raised on the main thread wherever it is, starting up or serving: the CLI
    then shuts down as on Ctrl-C. Ray's own handler, which ray.init installs, aborts the
    process with nothing shut down (seen: HAProxy outlived a server stopped while its app
    was still deploying, its Ingress already answering)."""


def _stopped(*_) -> None:
    raise Stopped


STOPS = (KeyboardInterrupt, Stopped)


@contextlib.contextmanager
def until_stopped() -> Iterator[None]:
    """Ends its block quietly on Ctrl-C or SIGTERM, and on nothing else. A signal handled
    while Ray's core waits in `ray.get` (serve.start waits for its proxies) comes out as a
    SystemError caused by the handler's exception (seen: a server stopped while deploying
    exited 1, "returned a result with an exception set")."""
    try:
        yield
    except STOPS:
        pass
    except SystemError as e:
        if not isinstance(e.__cause__, STOPS):
            raise


def say(line: str) -> None:
    """One ``slimserve: ...`` line, written whole and flushed: ``print`` writes the text and
    its newline apart, and Ray's log thread in this process could write a replica's line
    between them (seen: a test read the panels URL with a replica's log glued on)."""
    sys.stdout.write(f"slimserve: {line}\n")
    sys.stdout.flush()
