"""No process a test started may outlive the test session (tests/conftest.py checks it)."""

from __future__ import annotations

import time

import psutil

# Interpreter helpers that end with this process, not leaks: the multiprocessing
# resource tracker and forkserver (SLIMSERVE_TP_START_METHOD=forkserver).
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _describe(p: psutil.Process) -> str | None:
    try:
        cmd = " ".join(p.cmdline())
        if p.status() == psutil.STATUS_ZOMBIE or any(h in cmd for h in _HELPERS):
            return None
        return f"pid {p.pid}: {cmd[:160]}"
    except psutil.Error:  # exited meanwhile
        return None


def leftover_processes(wait_s: float = 20.0) -> list[str]:
    """This process's live descendants (helpers excepted), after up to wait_s for them to
    exit on their own (Ray's raylet and workers take a few seconds after ray.shutdown)."""
    end = time.monotonic() + wait_s
    while True:
        me = psutil.Process()
        alive = [d for d in map(_describe, me.children(recursive=True)) if d]
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.5)
