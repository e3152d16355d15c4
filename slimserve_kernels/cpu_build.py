"""Just-in-time builds of the C++ CPU kernels (`csrc/*.cpp`), shared by their loaders.

Each source is one torch extension, built once per torch version and source with
`torch.utils.cpp_extension.load` into torch's extensions directory (`TORCH_EXTENSIONS_DIR`,
default ~/.cache/torch_extensions). The name carries a digest of the source, the torch
version and the torch install's path, so a changed source or torch rebuilds instead of
loading a stale module; the digest covers the `.cpp` and every header of `csrc/` (the
kernels share `vec16.h` and others), so a changed header rebuilds too. The sources are
compiled from copies inside the build directory, so checkouts at other paths (git
worktrees) of one venv with the same source share one build instead of rebuilding it in
turn. Two venvs (a CI clone's and a developer's) get a build
each: torch writes the venv's include and library paths into the build's `build.ninja`, so
one shared build directory was rebuilt every time the other venv loaded it (seen: a CLI
test timing out behind the other venv's rebuild lock). Concurrent first builds (several
processes or Ray replicas) are serialized by an `fcntl` lock beside the build directory,
which the kernel releases if its holder dies; torch's own lock file (`lock`, left behind by
a build that was killed, on which every later `load` would wait forever) is removed under
it. A build takes no -march flag: each source compiles its hot functions for AVX-512, AVX2
and baseline x86-64 (target attributes) and picks one at run time, so a cached build runs on
any x86-64 CPU.

`SLIMSERVE_CPU_KERNELS=0` turns every C++ CPU kernel off (read on every call, so a test can
switch it); callers then keep their PyTorch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
from collections.abc import Callable, Iterator
from functools import cache
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
ENV = "SLIMSERVE_CPU_KERNELS"
# In the digest: a change of how builds are laid out gets its own directories, so processes
# of an older checkout (loading from their source path) and a newer one do not rebuild one
# directory in turn.
_LAYOUT = b"source and csrc headers copied into the build directory"
# OpenMP on: ATen's `at::parallel_for` (ParallelOpenMP.h) splits work only where `_OPENMP` is
# defined at compile time; without -fopenmp every kernel ran on one thread whatever
# `torch.set_num_threads` said. The link names libgomp.so.1, the soname of the runtime torch
# ships and has already loaded, so the kernels share torch's thread pool and thread count.
_FLAGS = ["-O3", "-fopenmp"]


def enabled() -> bool:
    """False when SLIMSERVE_CPU_KERNELS is 0 / false / off."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def ready(on: bool, load: Callable[[], ModuleType | None], what, fallback, logger) -> bool:
    """A loader's `available()`: on (its `enabled()`), and built (`load()`, which builds at
    the first call). Logs once per kernel that it is off."""
    if not on:
        _log_off(what, fallback, logger)
        return False
    return load() is not None


@cache
def _log_off(what: str, fallback: str, logger: logging.Logger) -> None:
    logger.info("%s: the C++ kernel is off (%s=0); using %s", what, ENV, fallback)


def loader(
    stem: str, what: str, fallback: str, logger: logging.Logger
) -> tuple[Callable[[], bool], Callable[[], ModuleType | None]]:
    """A kernel loader's (available, load) for csrc/<stem>.cpp: `load()` builds it at its
    first call (cached; None, logged, where it cannot run), `available()` is on (ENV, read
    on every call, so a test can switch it) and built. `what` names the kernel in log lines,
    `fallback` what callers keep without it. A test makes the build fail by patching this
    module's `build` and clearing `load`'s cache (`load.cache_clear()`)."""

    @cache
    def load() -> ModuleType | None:
        return load_or_none(what, lambda: build(stem, what, logger), fallback, logger)

    def available() -> bool:
        return ready(enabled(), load, what, fallback, logger)

    return available, load


def load_or_none(what: str, build: Callable[[], ModuleType], fallback: str, logger):
    """A loader's cached `load()`: the built extension, or None (logged) where it cannot
    run: not x86-64, no compiler, a failed build. The caller keeps `fallback` then."""
    if not supported(what, logger):
        return None
    try:
        return build()
    except Exception as e:  # no compiler, a failed build: the torch path still works
        logger.warning("%s: C++ kernel build failed (%s); using %s", what, e, fallback)
        return None


def supported(what: str, logger: logging.Logger) -> bool:
    """Whether this CPU can run the C++ kernels (x86-64); logs `what`'s fallback if not."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return True
    logger.info("%s: no C++ kernel for %s; using the torch path", what, platform.machine())
    return False


def build_name(stem: str, source: bytes) -> str:
    """The extension's name, which keys its build directory: a changed source, torch
    version or torch install (another venv) builds anew."""
    where = (torch.__version__ + os.path.dirname(torch.__file__)).encode()
    flags = " ".join(_FLAGS).encode()
    return f"slimserve_{stem}_{hashlib.sha256(source + where + _LAYOUT + flags).hexdigest()[:12]}"


def build(stem: str, what: str, logger: logging.Logger) -> ModuleType:
    """Builds (or loads the cached build of) csrc/<stem>.cpp; raises if it does not build.
    `what` names the kernel in the log lines."""
    from torch.utils import cpp_extension

    files = source_files(stem)
    name = build_name(stem, b"".join(read(path) for path in files))
    build_dir = cpp_extension._get_build_directory(name, verbose=False)  # torch's own layout
    # A first build takes tens of seconds of one core (three instruction-set copies); say
    # so, or the first step that uses it looks hung. A cached build loads in well under 1 s.
    logger.info("%s: loading the C++ kernel (a first build takes ~40 s, once)", what)
    with _build_lock(build_dir):
        for path in files:  # same digest, same bytes: an existing copy is current
            copy = os.path.join(build_dir, os.path.basename(path))
            if not os.path.exists(copy):
                shutil.copyfile(path, copy + ".tmp")
                os.replace(copy + ".tmp", copy)
        module = cpp_extension.load(
            name=name,
            sources=[os.path.join(build_dir, f"{stem}.cpp")],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=build_dir,
        )
    logger.info("%s: C++ kernel loaded, %s (%s)", what, module.isa(), module.__file__)
    return module


def source_files(stem: str) -> list[str]:
    """csrc/<stem>.cpp, then every header of csrc/ by name: what the digest covers and the
    build directory gets a copy of."""
    headers = sorted(f for f in os.listdir(CSRC) if f.endswith(".h"))
    return [os.path.join(CSRC, f"{stem}.cpp")] + [os.path.join(CSRC, h) for h in headers]


def read(path: str) -> bytes:
    """A file's name and bytes, for the digest: a renamed header changes what an `#include`
    finds, so it is another source."""
    with open(path, "rb") as f:
        return os.path.basename(path).encode() + b"\0" + f.read()


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Holds an exclusive `fcntl` lock on `<build_dir>.lock` (released by the kernel when its
    holder exits, however it exits). Every build of this name takes it first, so torch's
    `lock` file found under it was left by a build that died: removed, or torch would wait
    for it forever."""
    with open(build_dir + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                log.warning("removing %s, left by a C++ kernel build that did not finish", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
