"""Fingerprint every Triton launch's PTX, to show that a refactor of the kernels leaves the
generated code as it was (no GPU needed; run without TRITON_INTERPRET).

    python tests/kernels/ptx_fingerprint.py [sm ...] > after.txt     # default: 90

One line per launch of tests/kernels/gpu_compile.py: target, kernel, then the PTX's hash
with line info stripped, the hash of its instruction sequence and of its instruction
multiset with register names and labels masked, and its instruction count. Run it on two
checkouts and compare the columns: shared `@triton.jit` helpers are inlined, so moving code
into one should leave the multiset equal (the order may move; gpu_compile.py checks that
registers and stack use stay the same).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_compile  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def ptx(fn, args, kwargs, target) -> str:
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig = {n: gpu_compile._arg_type(a) for n, a in zip(fn.arg_names, args)}
    sig.update({n: "constexpr" for n in kwargs})
    attrs = gpu_compile.divisibility(fn, args)  # as a real launch specializes them
    src = ASTSource(fn, sig, constexprs=kwargs, attrs=attrs)
    kernel = triton.compile(src, target=target, options=options)
    return kernel.asm["ptx"]


def fingerprint(text: str) -> str:
    text = "\n".join(ln for ln in text.splitlines() if not re.match(r"\s*(\.loc|\.file|//)", ln))
    text = re.sub(r"\.section\s+\.debug.*", "", text, flags=re.S)
    masked = re.sub(r"\$L__\w+", "L", re.sub(r"%[a-z]+[0-9]+", "%R", text))
    lines = [ln.strip() for ln in masked.splitlines() if ln.strip() and ln.strip() != "L:"]
    multiset = repr(sorted(Counter(lines).items()))

    def h(s: str) -> str:
        return hashlib.sha1(s.encode()).hexdigest()[:10]

    return f"{h(text)} seq={h(chr(10).join(lines))} multiset={h(multiset)} n={len(lines)}"


def main(archs: list[int]) -> None:
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for fn, args, kwargs in gpu_compile.launches(arch):
            consts = sorted((k, str(v)) for k, v in kwargs.items())
            print(f"sm_{arch} {fn.__name__} {fingerprint(ptx(fn, args, kwargs, target))} {consts}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90])
