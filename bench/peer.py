"""What both peer benchmarks share: vLLM's venv, the prompts, CPU accounting, statistics."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_VENV = os.environ.get("VLLM_VENV", os.path.join(ROOT, ".venv-vllm"))
PEER_PY = os.path.join(PEER_VENV, "bin", "python")
FIRST_ID = 4  # ids 0-3 are the default model's bos/eos/eos/pad: prompts avoid them


def ensure_peer_venv() -> str:
    """Builds .venv-vllm (scripts/peer_venv.sh, minutes the first time); its python."""
    if not os.path.exists(os.path.join(PEER_VENV, ".installed")):
        subprocess.run(["bash", os.path.join(ROOT, "scripts", "peer_venv.sh")], check=True)
    return PEER_PY


def random_prompts(seed: int, n: int, vocab: int, lo: int = 32, hi: int = 64) -> list[list[int]]:
    """n prompts of lo..hi random token ids; a fresh seed per batch and repeat, so no prompt
    repeats across batch sizes (no side profits from a warm prefix)."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def tree_cpu_s(pid: int, children: bool = True) -> float:
    """User + system CPU seconds of a process and (unless told not to) all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if children else [])]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@dataclass
class CpuWindow:
    """Cores each process tree used over a timed window: cpu seconds / wall seconds.
    trees: (pid, with children?) pairs; the bench process itself is counted without its
    children, which are the peer's processes."""

    trees: list[tuple[int, bool]]

    def _now(self) -> list[float]:
        return [tree_cpu_s(pid, kids) for pid, kids in self.trees]

    def __enter__(self) -> CpuWindow:
        self._cpu = self._now()
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t
        self.cores = [(b - a) / wall for a, b in zip(self._cpu, self._now())]


def settle(trees: list[tuple[int, bool]], idle_cores: float = 0.05, limit_s: float = 10.0) -> float:
    """Waits until the trees are idle (each < idle_cores over 0.2 s), at most limit_s: after
    a run vLLM's processes keep a core busy for a moment, which would be charged to the run
    that follows. Returns the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        with CpuWindow(trees) as w:
            time.sleep(0.2)
        if max(w.cores) < idle_cores:
            break
    return time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine_conditions() -> dict:
    """What else ran on the machine: the 1-minute load average before the run."""
    load = os.getloadavg()
    return {"loadavg_1m_5m_15m": [round(x, 2) for x in load], "cpus": os.cpu_count()}
