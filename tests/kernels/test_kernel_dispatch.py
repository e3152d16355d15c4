"""slimserve_kernels/__init__.py: reference on CPU, Triton when forced or on CUDA, no eager
triton import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import slimserve_kernels
from slimserve_kernels import reference

pytestmark = pytest.mark.triton


def _gemm_args():
    gen = torch.Generator().manual_seed(0)
    qw = torch.randint(0, 2**31 - 1, (16, 8), dtype=torch.int32, generator=gen)
    return torch.randn(2, 64, generator=gen), qw, torch.rand(16, 2, generator=gen), None, 32


def test_cpu_uses_reference_and_force_uses_triton(monkeypatch):
    calls = []
    fake_triton = lambda *a: calls.append("triton") or 0  # noqa: E731
    monkeypatch.setattr(slimserve_kernels, "triton_int4_gemm", fake_triton)
    monkeypatch.setattr(reference, "int4_gemm", lambda *a: calls.append("ref") or 0)
    slimserve_kernels.int4_gemm(*_gemm_args())
    with slimserve_kernels.force_triton():
        slimserve_kernels.int4_gemm(*_gemm_args())
    slimserve_kernels.int4_gemm(*_gemm_args())
    assert calls == ["ref", "triton", "ref"]


def test_forced_triton_matches_reference():
    args = _gemm_args()
    with slimserve_kernels.force_triton():
        out = slimserve_kernels.int4_gemm(*args)
    torch.testing.assert_close(out, reference.int4_gemm(*args), atol=1e-5, rtol=1e-5)


def test_dispatch_names_survive_submodule_import():
    """Every public name stays what it was after every module of the package loads (a
    submodule named like a dispatch function would replace it), and the package is a plain
    module (no __class__ swap guarding the names). Seen failing with a module
    slimserve_kernels/kv_write.py added: "kv_write is now a module"."""
    import importlib
    import pkgutil
    import types

    pytest.importorskip("triton")
    before = {name: getattr(slimserve_kernels, name) for name in slimserve_kernels.__all__}
    for info in pkgutil.iter_modules(slimserve_kernels.__path__):
        importlib.import_module(f"slimserve_kernels.{info.name}")
    for name, value in before.items():
        assert getattr(slimserve_kernels, name) is value, f"{name} is now a module"
    assert type(slimserve_kernels) is types.ModuleType
    test_forced_triton_matches_reference()


def test_import_without_triton():
    """`import slimserve_kernels` and the CPU dispatch work when triton cannot be imported."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, slimserve_kernels\n"
        "assert not slimserve_kernels.triton_available()\n"
        "with slimserve_kernels.force_triton():\n"
        "    y = slimserve_kernels.int4_gemm(torch.randn(2, 64),\n"
        "        torch.zeros(16, 8, dtype=torch.int32), torch.ones(16, 2), None, 32)\n"
        "assert y.shape == (2, 16) and 'triton' not in str(type(sys.modules['triton']))\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
