"""Waiting in tests for what a cluster does on its own schedule (store hit counts, the
hand-off box emptying): poll a check until it holds or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(check: Callable[[], bool], deadline_s: float = 10.0) -> bool:
    """Whether ``check()`` held within ``deadline_s`` (polled every 50 ms)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False
