"""Shared fixtures: tiny random Hugging Face checkpoints built with `transformers`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402

from tiny_models import FAMILIES, make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """family name -> path of a tiny random checkpoint (built once per session)."""
    made = {}

    def get(family: str = "llama", **overrides) -> str:
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(family)
            made[key] = make_checkpoint(family, str(out), **overrides)
        return made[key]

    return get


@pytest.fixture(scope="session")
def llama_path(checkpoint_factory):
    return checkpoint_factory("llama")


@pytest.fixture(params=sorted(FAMILIES))
def family_path(request, checkpoint_factory):
    return checkpoint_factory(request.param)
