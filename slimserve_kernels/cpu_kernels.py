"""All the C++ CPU kernels at once (each has its own loader: cpu_paged, cpu_linear, cpu_fused,
cpu_tag)."""

from __future__ import annotations

from slimserve_kernels import cpu_fused, cpu_linear, cpu_paged, cpu_tag


def build_all() -> dict[str, bool]:
    """Builds (or loads) every C++ CPU kernel now; -> {kernel: available}. The engine calls it
    when a CPU model is loaded, so a first build (tens of seconds each, once per source and
    torch version) happens at start, not inside the first request's step."""
    return {m.WHAT: m.available() for m in (cpu_paged, cpu_linear, cpu_fused, cpu_tag)}
