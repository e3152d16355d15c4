"""`slimserve serve` with its Ray dashboard (and `--metrics`' Prometheus), in its own process
and Ray, as a user starts it after `make serve`; what it printed is how the tests find the
dashboard and its sign-in, so a wrong line fails them as it would mislead a user."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import yaml
from loopback import free_port
from reliability.serve.cli_server import LOGS_LINE, _env, _stop, _tail

READY_S = 300.0
DASHBOARD_LINE = re.compile(r"slimserve: Ray dashboard on (http://\S+)")
TOKEN_LINE = re.compile(r"slimserve: dashboard sign in with the token in (\S+)")
PANELS_LINE = re.compile(r"slimserve: slimserve panels on (http://\S+)")


@dataclass
class DashboardServer:
    api_url: str  # http://127.0.0.1:<port>: the OpenAI API
    dashboard_url: str  # as printed: http://127.0.0.1:<port>/#/serve
    token_source: str  # as printed: a path, or $RAY_AUTH_TOKEN
    panels_url: str  # the Prometheus console page of slimserve's panels
    ray_logs: str  # the Ray session's logs folder
    log_path: str

    @property
    def dashboard_root(self) -> str:
        return self.dashboard_url.split("/#", 1)[0]

    @property
    def prometheus_url(self) -> str:
        return self.panels_url.split("/consoles/", 1)[0]

    def token(self) -> str:
        """The token where the server's sign-in line said it is."""
        if self.token_source.startswith("$"):
            return os.environ[self.token_source[1:]]
        with open(os.path.expanduser(self.token_source)) as f:
            return f.read().strip()

    def log(self) -> str:
        return _tail(self.log_path, 20000)


@contextlib.contextmanager
def dashboard_server(config: dict, extra_args: list[str] = ()) -> Iterator[DashboardServer]:
    """`slimserve serve --config <config> --metrics` on free loopback ports (the dashboard
    on by default, as `make serve` runs it); stopped with SIGTERM after."""
    tmp = tempfile.mkdtemp(prefix="ss-dash-")  # HAProxy: socket paths <= 97
    path = os.path.join(tmp, "serve.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    http_port = free_port()
    cmd = [sys.executable, "-m", "app.cli", "serve", "--config", path, "--grpc-port", "0"]
    cmd += ["--port", str(http_port), "--num-cpus", "2", "--dashboard-port", str(free_port())]
    cmd += ["--metrics", "--metrics-port", str(free_port()), *extra_args]
    log_path = os.path.join(tmp, "serve.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(tmp), start_new_session=True
        )
    try:
        yield _wait_ready(proc, f"http://127.0.0.1:{http_port}", log_path)
    finally:
        _stop(proc, log_path)
        shutil.rmtree(tmp, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, api_url: str, log_path: str) -> DashboardServer:
    """Ready once the API answers and every line a user reads is printed (the panels line
    comes last)."""
    end = time.monotonic() + READY_S
    while True:
        assert proc.poll() is None, f"slimserve serve exited: {_tail(log_path)}"
        with open(log_path, errors="replace") as f:
            out = f.read()
        if PANELS_LINE.search(out):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(api_url + "/v1/models", timeout=5).status_code == 200:
                    return _parse(out, api_url, log_path)
        assert time.monotonic() < end, f"not ready in {READY_S} s: {_tail(log_path)}"
        time.sleep(1)


def _parse(out: str, api_url: str, log_path: str) -> DashboardServer:
    dashboard = DASHBOARD_LINE.search(out)
    assert dashboard, f"slimserve serve printed no dashboard URL:\n{out[-3000:]}"
    token = TOKEN_LINE.search(out)
    assert token, f"slimserve serve printed no dashboard sign-in:\n{out[-3000:]}"
    panels, logs = PANELS_LINE.search(out), LOGS_LINE.search(out)
    assert logs, f"slimserve serve printed no Ray logs folder:\n{out[-3000:]}"
    return DashboardServer(
        api_url, dashboard.group(1), token.group(1), panels.group(1), logs.group(1), log_path
    )
