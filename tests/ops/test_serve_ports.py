"""`slimserve serve` checks its fixed ports before Ray starts (app/serve/ports.py): a port in
use is a clear error naming the port, what it is for, what moves it and who holds it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from loopback import free_port

from app.serve.ports import ALL_INTERFACES, Listener, PortsInUse, check_free, listeners

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def held(host: str = "127.0.0.1") -> socket.socket:
    """A listening socket on a free port (the caller closes it)."""
    s = socket.socket()
    s.bind((host, 0))
    s.listen()
    return s


def test_a_held_port_is_named_with_its_option_and_holder():
    """Seen failing with in_use() returning False: check_free passed a held port."""
    with held() as s:
        port = s.getsockname()[1]
        wanted = [Listener("the OpenAI API", "127.0.0.1", port, "--port")]
        with pytest.raises(PortsInUse) as e:
            check_free(wanted)
    text = str(e.value)
    assert f"127.0.0.1:{port} for the OpenAI API (set by --port)" in text
    assert f"held by pid {os.getpid()}" in text


def test_free_ports_pass_and_only_the_held_one_is_named():
    with held() as s:
        busy = s.getsockname()[1]
        free = free_port()
        check_free([Listener("a", "127.0.0.1", free, "--a")])  # no error
        with pytest.raises(PortsInUse) as e:
            check_free([Listener("a", "127.0.0.1", free, "--a"),
                        Listener("b", "127.0.0.1", busy, "--b")])  # fmt: skip
    assert f":{busy} for b" in str(e.value) and f":{free}" not in str(e.value)


def test_haproxy_adds_its_stats_metrics_and_fallback_ports():
    """Ray Serve 2.60's defaults (docs/serving.md "Proxy"), each with its variable."""
    plain = listeners("127.0.0.1", 8000, 9000, haproxy=False)
    assert [(x.port, x.moved_by) for x in plain] == [(8000, "--port"), (9000, "--grpc-port")]
    ha = {x.moved_by: (x.host, x.port) for x in listeners("127.0.0.1", 8000, 9000, haproxy=True)}
    assert ha["RAY_SERVE_HAPROXY_STATS_PORT"] == (ALL_INTERFACES, 8404)
    assert ha["RAY_SERVE_HAPROXY_METRICS_PORT"] == (ALL_INTERFACES, 9101)
    assert ha["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"] == ("127.0.0.1", 8500)
    assert ha["RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"] == (ALL_INTERFACES, 9500)
    no_grpc = listeners("127.0.0.1", 8000, 0, haproxy=True)
    assert not any("gRPC" in x.what for x in no_grpc)


def test_serve_refuses_a_held_haproxy_port_before_starting_ray():
    """The stats port moved to one this test holds (as an HAProxy left by a killed server
    would hold 8404): `slimserve serve` exits 1 within seconds, naming it, and starts no Ray.
    Seen failing without the check: Ray started, and HAProxy's start-up failed in an actor
    traceback ("cannot bind socket")."""
    with held(ALL_INTERFACES) as s:
        stats = s.getsockname()[1]
        env = {**os.environ, "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "PYTHONPATH": ROOT}
        cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(free_port()),
               "--grpc-port", "0", "--no-dashboard"]  # fmt: skip
        started = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        took = time.monotonic() - started
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"0.0.0.0:{stats} for HAProxy's stats page (set by RAY_SERVE_HAPROXY_STATS_PORT)" in (
        out.stderr
    )
    assert "Ray" not in out.stdout and took < 60, (took, out.stdout[-1000:])
