"""The fixed ports `slimserve serve` listens on, checked before Ray starts.

A port in use otherwise fails seconds later inside Ray: a traceback from the HAProxyManager
actor ("HAProxy crashed during startup ... cannot bind socket") among Ray's start-up logs,
or a proxy that never comes up. The ports HAProxy adds (stats, Prometheus metrics) and the
fallback proxy's are not on the command line at all, so the usual cause there is a second
server on the machine, or an HAProxy left behind by one killed with its whole process group
(its GCS died first, so it could not stop its proxy). Checked here, the error names the
port, what it is for, the option or variable that moves it, and the process holding it.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

ALL_INTERFACES = "0.0.0.0"


@dataclass(frozen=True, slots=True)
class Listener:
    what: str  # what listens there
    host: str
    port: int
    moved_by: str  # the option or environment variable that picks the port


def listeners(host: str, port: int, grpc_port: int, haproxy: bool) -> list[Listener]:
    """What `slimserve serve` binds at fixed ports, as Ray Serve 2.60 binds them
    (docs/serving.md "Proxy"). Ray's constants are read after the proxy switch is set."""
    found = [Listener("the OpenAI API", host, port, "--port")]
    if grpc_port:
        found.append(Listener("the gRPC API", host, grpc_port, "--grpc-port"))
    if not haproxy:
        return found
    from ray.serve._private import constants as c

    found += [
        Listener("HAProxy's stats page", ALL_INTERFACES, c.RAY_SERVE_HAPROXY_STATS_PORT,
                 "RAY_SERVE_HAPROXY_STATS_PORT"),
        Listener("HAProxy's Prometheus metrics", ALL_INTERFACES,
                 c.RAY_SERVE_HAPROXY_METRICS_PORT, "RAY_SERVE_HAPROXY_METRICS_PORT"),
        Listener("Serve's fallback HTTP proxy", host, c.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT,
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"),
    ]  # fmt: skip
    if grpc_port:
        found.append(Listener("Serve's fallback gRPC proxy", ALL_INTERFACES,
                              c.RAY_SERVE_FALLBACK_PROXY_GRPC_PORT,
                              "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"))  # fmt: skip
    return found


def in_use(listener: Listener) -> bool:
    """Whether binding the listener's address fails because something holds it. Bound as
    the servers bind (SO_REUSEADDR): a port left in TIME_WAIT by a stopped server is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((listener.host, listener.port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def holder(port: int) -> str | None:
    """The process listening on ``port``, as "pid N (command line)", where this user may
    see it."""
    import psutil

    try:
        conns = psutil.net_connections(kind="inet")
    except psutil.Error:  # not allowed to list sockets here
        return None
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return None
            try:
                cmd = " ".join(psutil.Process(conn.pid).cmdline())
            except psutil.Error:
                cmd = "?"
            return f"pid {conn.pid} ({cmd[:120]})"
    return None


def busy_message(busy: list[Listener]) -> str:
    lines = ["these ports are in use:"]
    for b in busy:
        who = holder(b.port)
        held = f", held by {who}" if who else ""
        lines.append(f"  {b.host}:{b.port} for {b.what} (set by {b.moved_by}){held}")
    lines.append('stop what holds them, or move ours (docs/serving.md "Proxy")')
    return "\n".join(lines)


def check_free(wanted: list[Listener]) -> None:
    """Raises PortsInUse naming every listener whose port is taken."""
    busy = [w for w in wanted if in_use(w)]
    if busy:
        raise PortsInUse(busy_message(busy))


class PortsInUse(RuntimeError):
    pass
