"""`slimserve serve` in its own process (and its own Ray), as a user starts it.

For what must be fixed before Ray starts, such as the proxy (`--proxy`): the test session's
shared Ray (`ray_session`) cannot switch it. The server listens on free loopback ports; so do
the HAProxy helpers Ray would otherwise put on fixed ports (its fallback proxy, stats and
metrics), so that several runs on one machine never meet. Stopping it checks that no process
of its tree outlives it (they would escape the session's orphan check once re-parented).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import psutil
import yaml
from loopback import free_port

from app.serve.cli import LOCAL_DRAIN_S, RAY_GONE
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2 as pb
from app.serve.grpc_api.grpc_gen.slimserve.v1 import generation_pb2_grpc
from app.serve.reaper import HAPROXY, process_name

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READY_S, STOP_S = 300.0, 150.0
DRAIN_LINE = re.compile(r"Draining: staying reachable for ([0-9.]+)s")
LOGS_LINE = re.compile(r"slimserve: Ray logs in (\S+)")  # the Ray session's logs folder


@dataclass
class CliServer:
    url: str  # http://127.0.0.1:<port>
    channel: grpc.Channel
    stub: generation_pb2_grpc.GenerationStub
    log_path: str
    pid: int = 0  # the `slimserve serve` process (its tree is the application's)
    grpc_port: int = 0

    def engine_stats(self) -> pb.HealthResponse:
        """The engine replica's counters, asked through the proxy under test (gRPC Health)."""
        got = self.stub.Health(pb.HealthRequest(), timeout=30)
        assert got.kv_blocks_total > 0, f"Health carried no engine stats: {got}"  # {} = busy
        return got


def _env(tmp: str) -> dict[str, str]:
    path = os.pathsep.join([os.path.dirname(TESTS), TESTS, os.environ.get("PYTHONPATH", "")])
    return os.environ | {
        "PYTHONPATH": path,
        "TRITON_INTERPRET": "1",
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(free_port()),
        "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
        # HAProxy's files (config, admin socket) under a short path of this run's own.
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(tmp, "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(tmp, "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": tmp,
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(tmp, "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(tmp, "metrics.sock"),
    }


@contextlib.contextmanager
def cli_server(
    args: dict, proxy: str, dashboard: bool = False, group_stop: bool = False
) -> Iterator[CliServer]:
    """`slimserve serve --config <args> --proxy <proxy>` on free ports; stopped after with
    SIGTERM (to the CLI; ``group_stop``: to its whole process group, as `timeout` stops a
    command), with every process of its tree gone."""
    with _launched(args, proxy, dashboard) as (proc, server):
        try:
            _wait_ready(proc, server)
            yield server
        finally:
            _stop(proc, server.log_path, group_stop)
        if proxy == "haproxy" and not group_stop:  # Serve's shutdown ran and drained
            assert _drain_windows(server.log_path) == [float(LOCAL_DRAIN_S)]


def _drain_windows(log_path: str) -> list[float]:
    """The seconds each Ingress replica of the run stayed reachable once told to stop, from
    its log in the Ray session the CLI named (the CLI's drain setting reaches the replicas:
    with Ray's default every stop here waited 30 s)."""
    logs = next(m.group(1) for line in _said(log_path) if (m := LOGS_LINE.search(line)))
    found = []
    for path in glob.glob(os.path.join(logs, "serve", "replica_*_Ingress_*.log")):
        with open(path, errors="replace") as f:
            found += [float(m.group(1)) for m in DRAIN_LINE.finditer(f.read())]
    return found


@dataclass
class EarlyStop:
    returncode: int  # the CLI's
    said: list[str]  # its `slimserve: ...` lines


def stop_while_starting(args: dict, proxy: str, group_stop: bool = False) -> EarlyStop:
    """The same server, stopped as soon as its HAProxy runs (the app may still be deploying:
    the caller checks what the CLI said), with every process of its tree gone."""
    with _launched(args, proxy, dashboard=False) as (proc, server):
        end = time.monotonic() + READY_S
        while not any(process_name(p) == HAPROXY for p in _tree(proc)):
            assert proc.poll() is None, f"slimserve serve exited: {_tail(server.log_path)}"
            assert time.monotonic() < end, f"no HAProxy in {READY_S} s"
            time.sleep(0.1)
        _stop(proc, server.log_path, group_stop)
        return EarlyStop(proc.returncode, _said(server.log_path))


@contextlib.contextmanager
def _launched(args: dict, proxy: str, dashboard: bool) -> Iterator[tuple]:
    tmp = tempfile.mkdtemp(prefix="slimserve-cli-")
    http_port, grpc_port = free_port(), free_port()
    config = os.path.join(tmp, "serve.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"applications": [{"args": args}]}, f)
    cmd = [sys.executable, "-m", "app.cli", "serve", "--config", config, "--proxy", proxy]
    cmd += ["--port", str(http_port), "--grpc-port", str(grpc_port), "--num-cpus", "2"]
    # the dashboard costs CPU and fixed agent ports: only the tests that look at it start it
    cmd += ["--dashboard-port", str(free_port())] if dashboard else ["--no-dashboard"]
    log_path = os.path.join(tmp, "serve.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(tmp), start_new_session=True
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    server = CliServer(
        f"http://127.0.0.1:{http_port}",
        channel,
        generation_pb2_grpc.GenerationStub(channel),
        log_path,
        proc.pid,
        grpc_port,
    )
    try:
        yield proc, server
    finally:
        channel.close()
        if proc.poll() is None:  # the caller failed before it stopped the server
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, server: CliServer) -> None:
    end = time.monotonic() + READY_S
    while True:
        assert proc.poll() is None, f"slimserve serve exited: {_tail(server.log_path)}"
        try:
            if httpx.get(server.url + "/v1/models", timeout=5).status_code == 200:
                server.stub.ListModels(pb.ListModelsRequest(), timeout=10)
                return
        except (httpx.HTTPError, grpc.RpcError):
            pass
        assert time.monotonic() < end, f"not ready in {READY_S} s: {_tail(server.log_path)}"
        time.sleep(1)


def _tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _stop(proc: subprocess.Popen, log_path: str, group: bool = False) -> None:
    tree = _tree(proc) if proc.poll() is None else []
    if group:  # the CLI's session: the GCS and raylet share its group, workers do not
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this test started, nothing else
        proc.wait()
        raise AssertionError(f"slimserve serve ignored SIGTERM: {_tail(log_path)}") from None
    if group:  # its GCS and raylet went first: the CLI skipped the shutdowns that ask them
        said = _said(log_path)
        assert any(RAY_GONE in line for line in said), said
    _, alive = psutil.wait_procs(tree, timeout=30)
    left = [p for p in alive if _running(p)]
    for p in left:  # this test's tree, not necessarily its group (actors have their own)
        with contextlib.suppress(psutil.Error):
            p.kill()
    assert not left, f"outlived slimserve serve: {[(p.pid, _name(p)) for p in left]}"


def _said(log_path: str) -> list[str]:
    with open(log_path, errors="replace") as f:
        return [line.rstrip() for line in f if line.startswith("slimserve:")]


def _name(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:100]
    except psutil.Error:
        return "?"


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tail(path: str, chars: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-chars:]
