"""slimserve's top-level import names belong to slimserve alone.

Two distributions that ship the same top-level package overwrite each other on install and
shadow each other on import. transformers 5.25 started to depend on Hugging Face's `kernels`
distribution while our Triton package was also called `kernels`: every transformers import
then failed with `ImportError: cannot import name 'CUDAProperties' from 'kernels'`.
Seen to fail: with "kernels" added to the names read from pyproject.toml, the test reports
`{'kernels': ['kernels']}`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def our_top_level_packages() -> list[str]:
    """The names in pyproject's `packages.find include` (`app*` -> `app`)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.rstrip("*").rstrip(".") for pattern in include})


def test_no_other_installed_distribution_ships_our_top_level_packages():
    owners = importlib.metadata.packages_distributions()
    clashes = {
        name: others
        for name in our_top_level_packages()
        if (others := sorted(set(owners.get(name, [])) - {"slimserve"}))
    }
    assert not clashes, f"top-level packages shipped by other distributions too: {clashes}"


def test_our_top_level_packages_import_from_this_checkout():
    for name in our_top_level_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve().is_relative_to(ROOT), (name, spec.origin)
