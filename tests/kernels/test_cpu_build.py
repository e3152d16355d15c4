"""The C++ kernels' JIT build (slimserve_kernels/cpu_build.py) against a tiny source: a build
killed mid-way must not hang every later start, and two checkouts of one source share one
build. Each test builds in its own TORCH_EXTENSIONS_DIR, in a subprocess (torch caches
loaded extensions per process)."""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="the C++ kernels are x86-64"
)

# The kernel includes a header of csrc/, as the real ones do (vec16.h): the build compiles a
# copy in its build directory, so the header has to be copied there too.
TINY = textwrap.dedent(
    """
    #include <pybind11/pybind11.h>
    #include "tiny_name.h"
    static const char* isa() { return kTinyName; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("isa", &isa); }
    """
)
TINY_HEADER = 'static const char* kTinyName = "tiny";\n'
BUILD = textwrap.dedent(
    """
    import logging, sys
    from slimserve_kernels import cpu_build
    cpu_build.CSRC = sys.argv[1]
    module = cpu_build.build("tiny", "tiny", logging.getLogger("tiny"))
    print(module.__file__)
    """
)


def checkout(root, name: str) -> str:
    csrc = root / name
    csrc.mkdir()
    (csrc / "tiny.cpp").write_text(TINY)
    (csrc / "tiny_name.h").write_text(TINY_HEADER)
    return str(csrc)


def build(csrc: str, extensions: str, timeout_s: float = 240, script: str = BUILD) -> str:
    """The last line `script` prints (BUILD: the built module's path), run in a subprocess
    with csrc as its argument; fails the test if the build does not finish in time."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": extensions}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", script, csrc],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip().splitlines()[-1]


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path):
    extensions = tmp_path / "ext"
    first = build(checkout(tmp_path, "a"), str(extensions))
    build_dir = os.path.dirname(first)
    # What a build killed between taking torch's lock and finishing leaves behind.
    open(os.path.join(build_dir, "lock"), "w").close()
    os.remove(first)  # so the next load has to build again (under torch's lock)
    try:
        again = build(checkout(tmp_path, "b"), str(extensions), timeout_s=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the build waited on the stale lock file")
    assert os.path.exists(again)
    assert not os.path.exists(os.path.join(build_dir, "lock"))


def test_two_checkouts_of_one_source_share_one_build(tmp_path):
    extensions = str(tmp_path / "ext")
    first = build(checkout(tmp_path, "main"), extensions)
    built_at = os.stat(first).st_mtime_ns
    second = build(checkout(tmp_path, "worktree"), extensions)
    assert second == first
    assert os.stat(second).st_mtime_ns == built_at  # loaded, not rebuilt


def test_another_venv_builds_its_own(monkeypatch):
    """torch writes its install's paths into build.ninja: two venvs sharing one build
    directory rebuilt it each time the other loaded it. The name now differs per install
    (and per source), not per checkout.

    Seen failing: with the install path left out of the name."""
    import torch

    from slimserve_kernels import cpu_build

    here = cpu_build.build_name("x", b"source")
    assert cpu_build.build_name("x", b"source") == here
    assert cpu_build.build_name("x", b"other source") != here
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert cpu_build.build_name("x", b"source") != here


PARALLEL = textwrap.dedent(
    """
    #include <ATen/Parallel.h>
    #include <pybind11/pybind11.h>
    #include <mutex>
    #include <set>
    #include <thread>
    // How many OS threads one at::parallel_for over n items (grain 1) runs on.
    static int threads_used(int n) {
      std::set<std::thread::id> ids;
      std::mutex m;
      at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
        std::lock_guard<std::mutex> g(m);
        ids.insert(std::this_thread::get_id());
      });
      return static_cast<int>(ids.size());
    }
    static const char* isa() { return "parallel"; }
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
      m.def("threads_used", &threads_used);
      m.def("isa", &isa);
    }
    """
)
THREADS = textwrap.dedent(
    """
    import logging, sys, torch
    from slimserve_kernels import cpu_build
    cpu_build.CSRC = sys.argv[1]
    module = cpu_build.build("parallel", "parallel", logging.getLogger("parallel"))
    torch.set_num_threads(1)
    one = module.threads_used(8)
    torch.set_num_threads(2)
    print(one, module.threads_used(8))
    """
)


def test_kernels_split_work_over_torchs_threads(tmp_path):
    """ATen's at::parallel_for splits work only in code compiled with OpenMP; without it
    every C++ kernel ran on one thread whatever torch.set_num_threads said.

    Seen failing: with -fopenmp left out of the build's flags (1 thread at 2)."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    (csrc / "parallel.cpp").write_text(PARALLEL)
    assert build(str(csrc), str(tmp_path / "ext"), script=THREADS).split() == ["1", "2"]


def test_a_changed_header_is_another_build(tmp_path, monkeypatch):
    """The digest covers csrc's headers: an edited header would otherwise load the build of
    the old one. Seen failing: with the digest over the .cpp alone."""
    from slimserve_kernels import cpu_build

    def name() -> str:
        files = cpu_build.source_files("tiny")
        return cpu_build.build_name("tiny", b"".join(cpu_build.read(f) for f in files))

    monkeypatch.setattr(cpu_build, "CSRC", checkout(tmp_path, "csrc"))
    before = name()
    assert name() == before
    (tmp_path / "csrc" / "tiny_name.h").write_text(TINY_HEADER.replace("tiny", "tinier"))
    edited = name()
    assert edited != before
    (tmp_path / "csrc" / "tiny_name.h").rename(tmp_path / "csrc" / "other.h")
    assert name() != edited  # the same bytes, found by another #include
