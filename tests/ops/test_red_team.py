"""A hostile peer on the application's own TCP ports, against a running `slimserve serve`.

Every TCP port that a process of the application's tree listens on (found from the
processes, not from config: Ray's own servers, the delta inbox, the dashboard, HAProxy's
helpers), other than the HTTP and gRPC APIs, is sent garbage, an oversized frame length, and
a pickle gadget without credentials (raw, behind a 4-byte length, and behind a 16-byte
"token"), then held with many idle connections. Nothing may run the gadget (a marker file
it would create stays absent), none of the application's long-lived processes (Serve's
replicas and controller, Ray's GCS and raylet, the dashboard) may die, and the API must stay
healthy and answer a normal request within 2 s while the idle connections are held and
after.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import time

import httpx
import psutil
import pytest
from reliability.serve.cli_server import cli_server
from serve.apps import tiny_serve_args

pytestmark = [pytest.mark.ray, pytest.mark.slow]
IDLE_CONNECTIONS = 2000
ANSWER_WITHIN_S = 2.0


class Gadget:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def listening_ports(root_pid: int) -> dict[int, str]:
    """port -> process name, for every TCP listener of the process tree under ``root_pid``."""
    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    ports = {}
    for proc in procs:
        try:
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    ports[conn.laddr.port] = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return ports


# The application's long-lived processes: Serve's replicas and controller, Ray's GCS and
# raylet, the dashboard. (Ray starts and reaps idle workers on its own schedule: their
# coming and going is no crash.)
VITAL = ("ServeReplica", "ServeController", "gcs_server", "raylet", "dashboard")


def vital_processes(root_pid: int) -> dict[int, str]:
    out = {}
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        name = next((v for v in VITAL if v in line), None)
        if name is not None:
            out[proc.pid] = f"{name}: {line[:120]}"
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def send(port: int, payload: bytes) -> None:
    """One connection: write ``payload``, read whatever comes back briefly, close. Refused
    or reset is a fine answer to garbage."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 2) as s:
        s.sendall(payload)
        s.settimeout(0.3)
        s.recv(4096)


def hold_idle(port: int, n: int) -> list[socket.socket]:
    held = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect_ex(("127.0.0.1", port))
        except OSError:
            s.close()
            continue
        held.append(s)
    return held


def answers(url: str) -> float:
    """Seconds for /health and one short completion (both must succeed)."""
    start = time.perf_counter()
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 4, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def test_hostile_peers_on_every_internal_port_run_nothing_and_harm_nothing(
    tmp_path, checkpoint_factory
):
    args = tiny_serve_args(checkpoint_factory("llama"), mode="disaggregated")
    marker = str(tmp_path / "gadget-ran")
    gadget = pickle.dumps(Gadget(marker))
    attacks = [
        os.urandom(4096),
        struct.pack("!I", 0xFFFFFFF0) + os.urandom(64),
        gadget,
        struct.pack("!I", len(gadget)) + gadget,
        os.urandom(16) + struct.pack("!I", len(gadget)) + gadget,
    ]
    with cli_server(args, "haproxy", dashboard=True) as server:  # as `make serve` runs
        api_ports = {int(server.url.rsplit(":", 1)[1]), server.grpc_port}
        vital = vital_processes(server.pid)
        assert any("ServeReplica" in name for name in vital.values()), vital
        ports = {p: n for p, n in listening_ports(server.pid).items() if p not in api_ports}
        assert len(ports) >= 3, ports  # Ray's servers and the delta inbox at least
        assert answers(server.url) < 30  # warm
        slow = []
        for port, name in sorted(ports.items()):
            for payload in attacks:
                send(port, payload)
            held = hold_idle(port, IDLE_CONNECTIONS)
            try:
                seconds = answers(server.url)
                if seconds > ANSWER_WITHIN_S:
                    slow.append((port, name, round(seconds, 2)))
            finally:
                for s in held:
                    s.close()
        assert answers(server.url) < ANSWER_WITHIN_S
        assert not os.path.exists(marker), "a pickle gadget ran"
        gone = {pid: name for pid, name in vital.items() if not alive(pid)}
        assert not gone, f"processes died: {gone}"
        assert not slow, f"answers over {ANSWER_WITHIN_S}s while held: {slow}"
