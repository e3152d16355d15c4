"""Rerunning a C++ CPU kernel's tests under a capped instruction set: `SLIMSERVE_CPU_ISA`
caps the copy a kernel picks when its module loads, so the AVX2 and baseline copies (which
other CPUs pick) are tested on this one, each in a subprocess of its own."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rerun_under_isa(test_file: str, isa: str, selection: str, passed: int) -> None:
    """Runs `pytest test_file -k selection` under SLIMSERVE_CPU_ISA=isa; asserts it passed
    with exactly `passed` tests (a selection that stopped matching must not pass by
    running nothing)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            test_file,
            "-k",
            selection,
        ],
        env={**os.environ, "SLIMSERVE_CPU_ISA": isa},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{passed} passed" in run.stdout, run.stdout[-1000:]
