import pytest


@pytest.fixture(scope="module")
def tiny_model(checkpoint_factory):
    return checkpoint_factory("llama")
